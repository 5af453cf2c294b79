"""The step model's record: ``python -m bench.step_model record --out FILE`` writes it from
the CPU check and the GPU tables (no timing: every input is a committed record)."""

from __future__ import annotations

from .step_model_check import check_rows, check_table, signed_pct, summary
from .step_model_gpu import (
    KEEPS,
    GpuRates,
    gpu_ratio,
    gpu_tables,
    needed_share,
    sensitivity,
    smollm2_shape,
    target_shape,
)
from .step_model_records import (
    GPU_RECORD,
    K4_RECORD,
    METHOD_STEP_RECORDS,
    PROFILE_RECORD,
    ROOT,
    profile_prompt,
)


def render_record(rates: GpuRates) -> str:
    """The record's Markdown: the model, its check against the CPU records, the GPU tables."""
    rows = check_rows()
    k4 = [r for r in rows if r["source"] == K4_RECORD]
    prompt, suffix = profile_prompt()
    sm, tg = smollm2_shape(), target_shape()

    def span(xs, f="{:.2f}"):
        lo, hi = f.format(min(xs)), f.format(max(xs))
        return lo if lo == hi else f"{lo} to {hi}"

    short = [r["u_over_f"] for r in rows if not r["held"]]
    long_ = [r["u_over_f"] for r in rows if r["held"] and r["source"] != K4_RECORD]
    worst_k4 = max(k4, key=lambda r: abs(r["error"]))
    g50 = dict(length=4096, generation_share=0.5)
    full = [gpu_ratio(sh, rates, K=4, keep=1.0, **g50) for sh in (sm, tg)]
    quarter = [gpu_ratio(sh, rates, K=4, keep=0.25, **g50) for sh in (sm, tg)]
    k1 = [gpu_ratio(sh, rates, K=1, keep=q, **g50) for sh in (sm, tg) for q in KEEPS]
    need = [needed_share(sh, rates, 1.15, K=4, keep=0.5, length=4096) for sh in (sm, tg)]
    need_fu = [
        needed_share(sh, rates, 1.15, K=4, keep=0.25, length=4096, mode="from-update")
        for sh in (sm, tg)
    ]
    after_head = (
        "| run | pairs kept | generation share | measured | model (`separate`) "
        "| model, `own-forward` | model, `from-update` |\n|---|---|---|---|---|---|---|"
    )
    after = "\n".join(
        f"| {r['case']} | {r['kept']:g} of {r['pairs']:g} | {r['generation_share']:.0%} "
        f"| {r['measured']:.3f}x | {r['predicted']:.3f}x | {r['after_own_forward']:.3f}x "
        f"| {r['after_from_update']:.3f}x |"
        for r in k4
    )
    title = (
        "MRTPO's step over GDPO's from its measured parts: a small model, checked against the CPU"
    )
    return f"""# {title} records

Written by `python -m bench.step_model record --out <this file>` ({_commit()}); the model
and what each part means: `bench/step_model.py`. No timing was taken for
this record: every input is read from the committed records named below. **No GPU step is
measured in this project yet**: the GPU tables are the model's, from the H200 op rates of
[{GPU_RECORD}.md]({GPU_RECORD}.md) and an assumed decoder rate.

## The model

    GDPO  = G + U + A_gdpo  + (F where the old log-probs need their own forward, else H)
    MRTPO = G + U + A_mrtpo + (F where the with-information side needs its own forward, else H)
                + kept x u + (n + kept) x j

G generation, U the policy's forward with gradient + fused policy loss + backward (the same
in both arms), A the advantage op, F the with-information no-grad forward and old log-probs
of the n responses, H the update's head pass for the old log-probs where they are its own,
u one replay unit's forward per kept (response, reward) pair, j the fused JS per side (one
P side per response, one Q side per kept pair). Which forwards run
(`mrtpo.training.trainer.separate_old_forward`, `Trainer.replay_from_update`): `separate` (several
PPO epochs or minibatches; every CPU record below predates issue 43 item 1): both arms run
F; `own-forward` (one epoch and one minibatch, more responses than one update micro-batch):
GDPO runs H only, MRTPO runs F for the with-information hidden states; `from-update` (one
epoch, one minibatch, one micro-batch): both arms run H only.

## Checked against the CPU records

Each row predicts a measured ratio from the row's own GDPO step (G, U, A, F), its pairs
kept and two numbers carried from a different measurement, u / f and j / f (f = F / n, the
with-information forward per response of each measurement): from the other variant of the
same case (every pair replayed predicts half of them skipped, and back: the pairs-kept
scaling), else from the same model at another length (the length scaling), and for the
K = 4 training runs from the replay profile of the same batch and code
([{PROFILE_RECORD}]({PROFILE_RECORD}); generation, F and U from the run itself, summed
over steps 2-10 as [{K4_RECORD}]({K4_RECORD}) reads them). Records: the method-step CSVs of
{", ".join(f"[{n}]({n}.md)" for n in METHOD_STEP_RECORDS)} (process CPU time, a case
measured twice by its latest rows, as the report reads them). Error: predicted / measured
- 1.

{check_table(rows)}

{summary(rows)}.

Reading:

- **Pairs kept.** Predicting the half-skipped step from the full one (and back) is within
  {max(abs(r["error"]) for r in rows if r["held"] and r["donor"].startswith("other")):.1%} at
  1k-16k tokens: the replay's cost is its kept pairs times one unit forward, and the JS's
  its sides. At 64 tokens the unit's cost is mostly the prompt past its shared prefix, which
  depends on where each kept reward's span starts (u / f {span(short)} there,
  {span(long_)} from 1k on), so those rows are reported and not held to the tolerance.
- **The training runs.** With generation at
  {span([r["generation_share"] for r in k4], "{:.0%}")} of GDPO's step, the model gives
  {span([r["predicted"] for r in k4], "{:.2f}x")} where the side-by-side runs measured
  {span([r["measured"] for r in k4], "{:.2f}x")}; the largest miss ({worst_k4["case"]},
  {signed_pct(worst_k4["error"])}) is the run's own where the model is below it: the model is fed
  GDPO's rollouts and updates, and in run 6 MRTPO sampled longer answers from step 8 on (the
  record says so). Runs 4 and 6 ran on a quiet machine, runs 1 and 2 beside other jobs.
- **After issue 43 items 1-2** (one epoch, one minibatch; the K = 4 runs have 8 responses
  and 8-response micro-batches, so `from-update` applies), from the same parts with H
  carried from the profile's old-log-prob head pass:

{after_head}
{after}

  Both arms drop the same forward (F less H), so the ratio rises slightly: on this CPU the
  model puts the new step at {span([r["after_from_update"] for r in k4], "{:.3f}x")} GDPO's
  (the issue's bar: at most 1.15x); what is left is the replay's units and JS over a cheaper
  GDPO step.

## On a GPU: what decides the ratio (the model, not a measurement)

Every part from FLOP counts: a forward costs 2 x (decoder weights) + 4 x layers x d x
context FLOPs per token (prompt of {prompt} tokens and the response; context the mean over
the response), the with-information forward adds a log-prob head pass (2 d V per token),
a replay unit runs {suffix} prompt tokens past the shared prefix and the response, the
update runs 3 forwards' worth (4 with gradient checkpointing) plus the fused policy loss
(6 d V per token), the JS 2 d V per token and side. Prompt and unit suffix: the K = 4 task's
([{PROFILE_RECORD}]({PROFILE_RECORD})). Rates (TFLOP/s), from [{rates.source}]({rates.source}):
the fused policy loss {rates.policy_loss:g} and the fused JS {rates.js:g} as measured on the
H200 at d = 4096, V = 151936, N = 16384 (used for both shapes: at SmolLM2's d = 576 the
JS's row work is a larger share, so its head parts are optimistic there); the decoder's
forward and backward at {rates.decoder:.0f} ({rates.decoder / rates.gemm:.0%} of the
{rates.gemm:g} TFLOP/s bf16 GEMM ceiling measured there): an assumption, since no decoder
step has been timed on a GPU in this project; MRTPO's token advantages at
{rates.advantages_ms_per_mtok:.3f} ms per million (token, reward) entries (measured there).
An H100 would change the absolute times, not these ratios, as long as the decoder and the
head ops lose speed alike. Shapes: {sm.name} ({sm.layers} layers, d = {sm.d}, FFN {sm.ffn},
V = {sm.vocab}; d and V from the method-step records, the rest its published config) and an
{tg.name} decoder at the kernels' target d = {tg.d} and V = {tg.vocab} (the H200 record's;
{tg.layers} layers, FFN {tg.ffn}, key/value width {tg.kv_dim}: Qwen3-8B's published config).
Generation share: of GDPO's step under the same mode.

{gpu_tables(rates)}
Sensitivity at K = 4, half the pairs kept, 4k tokens, generation 50 %:

{sensitivity(rates)}

Reading:

- **What decides it is the count of forwards.** MRTPO adds one forward per kept pair (q K)
  and, in `own-forward`, the with-information forward, against GDPO's update of about 3
  forwards; the head ops (the JS's sides against GDPO's policy loss and head pass) come out
  in about the same proportion at both shapes, so neither the shape nor the assumed decoder
  rate moves the ratio much. The ratio is about 1 + (1 - g) (q K + 1) / 3 in `own-forward`
  and 1 + (1 - g) q K / 3 in `from-update`, with g the generation share.
- **The response length hardly moves it**: attention grows every forward alike (the
  replay's, the update's), and the JS grows linearly. On a GPU, length acts through the
  generation share (decoding long responses is memory-bound and grows with them).
- **Pairs kept x K is the lever.** At 50 % generation and 4k tokens, K = 4 with every pair
  kept costs {span(full, "{:.2f}x")}, a quarter kept {span(quarter, "{:.2f}x")}; K = 1 costs
  {span(k1, "{:.2f}x")}.
- **The 1.15x bar** needs a generation share of {_shares(need)} at K = 4 with half of
  the pairs kept (`own-forward`), or {_shares(need_fu)} with a quarter kept on the
  `from-update` path (one micro-batch); the last rows of the sensitivity table give the
  other cases.
"""


def _shares(xs: list[float | None]) -> str:
    """Generation shares as text, one per distinct value ("never": not reachable)."""
    out = []
    for x in xs:
        t = "never" if x is None else f"{x:.0%}"
        if t not in out:
            out.append(t)
    return " / ".join(out)


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return f"checkout at {out.stdout.strip()}"
    except (OSError, subprocess.CalledProcessError):
        return "checkout of unknown commit"

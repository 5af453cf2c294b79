"""The step model on a GPU: every part from FLOP counts, the H200 rates of the fused ops
(read from the committed record) and an assumed decoder rate; the tables by generation
share, pairs kept, K and response length, and the sensitivity to each assumption."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, replace

from .step_model_parts import Parts, step_times
from .step_model_records import GPU_RECORD, RESULTS, profile_prompt


@dataclass(frozen=True)
class Shape:
    """A decoder's shape for FLOP counts (attention heads x head size = d)."""

    name: str
    layers: int
    d: int
    ffn: int
    kv_dim: int  # key/value projection width (GQA)
    vocab: int

    def params(self) -> float:
        """Decoder weights the matmuls use per token (no embedding, no LM head)."""
        attn = 2 * self.d * self.d + 2 * self.d * self.kv_dim
        return self.layers * (attn + 3 * self.d * self.ffn)

    def forward_flops(self, tokens: float, context: float) -> float:
        """A forward of ``tokens`` tokens each attending to ``context`` tokens on average."""
        return tokens * (2 * self.params() + 4 * self.layers * self.d * context)


def smollm2_shape() -> Shape:
    """SmolLM2-135M: d and V as the method-step records give them; 30 layers, FFN 1536 and
    3 key/value heads of 64 from its published config (not in the records)."""
    with open(RESULTS / "method-step-2026-12-05" / "method_step.csv", newline="") as fh:
        row = next(r for r in csv.DictReader(fh) if r["model"] == "smollm2-135m-instruct")
    return Shape("SmolLM2-135M", 30, int(row["d"]), 1536, 192, int(row["V"]))


def target_shape() -> Shape:
    """The kernels' target shape (d = 4096, V = 151936, the H200 record's): an 8B-class
    decoder of 36 layers, FFN 12288, 8 key/value heads of 128 (Qwen3-8B's published
    config; d and V as the record gives them)."""
    with open(RESULTS / GPU_RECORD / "check" / "results.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    return Shape("8B-class", 36, int(row["d"]), 12288, 1024, int(row["V"]))


@dataclass(frozen=True)
class GpuRates:
    """TFLOP/s. ``policy_loss`` and ``js``: the fused ops measured on the H200 (bf16, N =
    16384, d = 4096, V = 151936, fp32 out); ``gemm``: that machine's bf16 GEMM ceiling;
    ``decoder``: the decoder's forward and backward, assumed ``decoder_share`` of the
    GEMM ceiling (not measured in this project); ``advantages_ms_per_mtok``: MRTPO's token
    advantages per million (token, reward) entries, measured there too."""

    gemm: float
    policy_loss: float
    js: float
    decoder: float
    advantages_ms_per_mtok: float
    source: str


def h200_rates(decoder_share: float = 0.5) -> GpuRates:
    if not 0 < decoder_share <= 1:
        raise ValueError(f"decoder_share: expected a share in (0, 1], got {decoder_share}")
    rec = RESULTS / GPU_RECORD
    gemm = float(
        re.search(r"bf16 GEMM (\d+) TFLOP/s", (rec.parent / f"{GPU_RECORD}.md").read_text()).group(
            1
        )
    )
    with open(rec / "check" / "results.csv", newline="") as fh:
        rows = {(r["op"], r["provider"]): r for r in csv.DictReader(fh)}
    pol = float(rows[("linear_policy_loss_fwd_bwd", "mrtpo-triton")]["tflops"])
    js = float(rows[("linear_js_distance", "mrtpo-triton")]["tflops"])
    adv = rows[("advantages", "mrtpo-triton")]
    adv_rate = float(adv["ms_p50"]) / (int(adv["N"]) * int(adv["K"]) / 1e6)
    return GpuRates(gemm, pol, js, gemm * decoder_share, adv_rate, f"{GPU_RECORD}.md")


def gpu_parts(
    shape: Shape,
    rates: GpuRates,
    *,
    K: int,
    keep: float,
    length: int,
    generation_share: float,
    prompt: int | None = None,
    suffix: int | None = None,
    mode: str = "own-forward",
    checkpointing: bool = False,
    unit_efficiency: float = 1.0,
) -> Parts:
    """One response's step on a GPU from FLOP counts (ms): F = a no-grad forward of prompt
    and response plus the log-prob head pass (2 d V per token); u = a forward of ``suffix``
    prompt tokens and the response at the same context (``unit_efficiency`` x its time);
    U = forward and backward (3 forwards; 4 with ``checkpointing``) plus the fused policy
    loss (6 d V per token); j = 2 d V per token at the fused JS's rate; G from the
    generation share of GDPO's step under ``mode``. ``prompt`` and ``suffix`` (tokens)
    default to the K = 4 task's, as the replay profile measured them (``profile_prompt``)."""
    if not 0 <= generation_share < 1:
        raise ValueError(f"generation_share: expected [0, 1), got {generation_share}")
    if not 0 <= keep <= 1:
        raise ValueError(f"keep: expected a share in [0, 1], got {keep}")
    if length < 1 or K < 1:
        raise ValueError(f"length, K: expected >= 1, got {length}, {K}")
    if prompt is None or suffix is None:
        got = profile_prompt()
        prompt = got[0] if prompt is None else prompt
        suffix = got[1] if suffix is None else suffix
    ms = lambda flops, tflops: flops / (tflops * 1e12) * 1e3  # noqa: E731
    dv = 2 * shape.d * shape.vocab  # head FLOPs per token
    fwd = ms(shape.forward_flops(prompt + length, (prompt + length) / 2), rates.decoder)
    head = ms(dv * length, rates.policy_loss)
    unit = ms(shape.forward_flops(suffix + length, prompt + length / 2), rates.decoder)
    update = fwd * (4 if checkpointing else 3) + ms(3 * dv * length, rates.policy_loss)
    p = Parts(
        responses=1,
        K=K,
        kept=keep * K,
        generation=0.0,
        update=update,
        info_forward=fwd + head,
        unit_per_pair=unit * unit_efficiency,
        js_per_side=ms(dv * length, rates.js),
        advantages_mrtpo=rates.advantages_ms_per_mtok * length * K / 1e6,
        head_pass=head,
    )
    gdpo = step_times(p, mode)["gdpo"]
    return replace(p, generation=gdpo * generation_share / (1 - generation_share))


def gpu_ratio(shape: Shape, rates: GpuRates, **kw) -> float:
    mode = kw.get("mode", "own-forward")
    return step_times(gpu_parts(shape, rates, **kw), mode)["ratio"]


def needed_share(shape: Shape, rates: GpuRates, target: float, **kw) -> float | None:
    """The smallest generation share at which the ratio is at most ``target`` (bisection;
    the ratio falls as the share grows), or None where even 99.9 % does not reach it."""
    lo, hi = 0.0, 0.999
    if gpu_ratio(shape, rates, generation_share=hi, **kw) > target:
        return None
    if gpu_ratio(shape, rates, generation_share=lo, **kw) <= target:
        return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        if gpu_ratio(shape, rates, generation_share=mid, **kw) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def sensitivity(rates: GpuRates) -> str:
    """The ratio at one point (K = 4, half kept, 4k tokens, generation 50 %) as each
    assumption moves, and the generation share a 1.15x step needs."""
    base = dict(K=4, keep=0.5, length=4096, generation_share=0.5)
    lines = ["| assumption | SmolLM2-135M | 8B-class |", "|---|---|---|"]
    shapes = (smollm2_shape(), target_shape())

    def row(what, fn):
        lines.append(f"| {what} | " + " | ".join(fn(sh) for sh in shapes) + " |")

    row("as in the tables (`own-forward`)", lambda sh: f"{gpu_ratio(sh, rates, **base):.2f}x")
    for share in (0.35, 0.7):
        alt = replace(rates, decoder=rates.gemm * share)
        row(
            f"decoder at {share:.0%} of the GEMM ceiling (tables: "
            f"{rates.decoder / rates.gemm:.0%})",
            lambda sh, alt=alt: f"{gpu_ratio(sh, alt, **base):.2f}x",
        )
    row(
        "replay units at 1.5x the packed forward's time per token",
        lambda sh: f"{gpu_ratio(sh, rates, unit_efficiency=1.5, **base):.2f}x",
    )
    row(
        "gradient checkpointing (the update: 4 forwards)",
        lambda sh: f"{gpu_ratio(sh, rates, checkpointing=True, **base):.2f}x",
    )
    row(
        "`from-update` (the batch one update micro-batch)",
        lambda sh: f"{gpu_ratio(sh, rates, mode='from-update', **base):.2f}x",
    )
    row(
        "`separate` (several PPO epochs or minibatches)",
        lambda sh: f"{gpu_ratio(sh, rates, mode='separate', **base):.2f}x",
    )
    for mode in ("own-forward", "from-update"):
        for q in (0.25, 0.5):

            def need(sh, mode=mode, q=q):
                g = needed_share(sh, rates, 1.15, K=4, keep=q, length=4096, mode=mode)
                return "never" if g is None else f"{g:.0%}"

            row(f"generation share for at most 1.15x (K = 4, {q:.0%} kept, `{mode}`)", need)
    return "\n".join(lines)


GEN_SHARES = (0.30, 0.50, 0.70, 0.85)
LENGTHS = (1024, 4096, 16384)
KEEPS = (0.25, 0.5, 0.75, 1.0)


def gpu_tables(rates: GpuRates | None = None) -> str:
    rates = rates or h200_rates()
    out = []
    for shape in (smollm2_shape(), target_shape()):
        out.append(
            f"### {shape.name}: {shape.layers} layers, d = {shape.d}, FFN {shape.ffn}, "
            f"V = {shape.vocab}\n"
        )
        out.append(
            "K = 4, half of the pairs kept, by generation share of GDPO's step and "
            "response length (mode `own-forward`; `from-update` in brackets):\n"
        )
        out.append(
            "| generation share | " + " | ".join(f"{n // 1024}k tokens" for n in LENGTHS) + " |"
        )
        out.append("|---|" + "---|" * len(LENGTHS))
        for g in GEN_SHARES:
            cells = []
            for n in LENGTHS:
                a = gpu_ratio(shape, rates, K=4, keep=0.5, length=n, generation_share=g)
                b = gpu_ratio(
                    shape, rates, K=4, keep=0.5, length=n, generation_share=g, mode="from-update"
                )
                cells.append(f"{a:.2f}x ({b:.2f}x)")
            out.append(f"| {g:.0%} | " + " | ".join(cells) + " |")
        out.append(
            "\nGeneration 50 % of GDPO's step, 4k-token responses, by K and the share of "
            "pairs kept (mode `own-forward`):\n"
        )
        out.append("| K | " + " | ".join(f"{q:.0%} kept" for q in KEEPS) + " |")
        out.append("|---|" + "---|" * len(KEEPS))
        for k in (1, 2, 3, 4):
            cells = [
                f"{gpu_ratio(shape, rates, K=k, keep=q, length=4096, generation_share=0.5):.2f}x"
                for q in KEEPS
            ]
            out.append(f"| {k} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)

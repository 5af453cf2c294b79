"""The contrastive replay of one K = 4 real-model batch, timed by part, the old and the new
forward paths side by side in one process (issue 33 item 2).

The batch is ``mrtpo train``'s on issue 25's settings (``bench.k4_step_time.SETTINGS``:
SmolLM2-135M-Instruct warm-started, constraints-real with 4 rewards, 2 prompts x 4 samples,
bfloat16 autocast, one thread): one rollout sampled, its responses cut or extended to
``--tokens`` tokens each (the replay's cost depends on the shapes, not on the text). Then,
alternating ``--repeats`` times, the replay engine (``mrtpo.replay.engine._replay_core``, as
``contrastive_replay`` calls it) with ``reuse=False`` (every replay unit runs its whole
prompt without spans; one JS over every row and stream with a kept pair) and ``reuse=True``
(units start from the full prompt's key/value cache at their common token prefix; JS per
group of kept streams). Parts timed (medians): the with-information forward, the old
log-probs, the unit forwards, the fused JS. ``--mask rewards`` replays only the pairs whose
GDPO advantage is not 0 (what ``mrtpo train`` does), ``none`` every pair with spans.

    python -m bench.replay_profile --out runs/replay-profile \
        --record bench/results/replay-profile-DATE.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

PARTS = ("with_info", "old_logprobs", "units", "js")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


class _Timer:
    """Wraps the replay module's forward, log-prob and JS calls to add up their seconds."""

    def __init__(self, replay_mod):
        self.mod, self.sec = replay_mod, dict.fromkeys(PARTS, 0.0)
        self.saved = {n: getattr(replay_mod, n) for n in
                      ("_rows_hidden", "linear_logprobs", "linear_js_distance")}  # fmt: skip

    def _wrap(self, name, part_of):
        real = self.saved[name]

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = real(*args, **kwargs)
            self.sec[part_of(kwargs)] += time.perf_counter() - t
            return out

        return timed

    def __enter__(self):
        m = self.mod
        m._rows_hidden = self._wrap(
            "_rows_hidden", lambda kw: "units" if "prefix" in kw else "with_info"
        )
        m.linear_logprobs = self._wrap("linear_logprobs", lambda kw: "old_logprobs")
        m.linear_js_distance = self._wrap("linear_js_distance", lambda kw: "js")
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(self.mod, n, f)


def batch(args):
    """The trainer, its model and one rollout of the K = 4 settings (responses at
    ``args.tokens`` tokens)."""
    from bench.k4_step_time import SETTINGS, warm_start
    from mrtpo.cli import build_parser, config_from_args
    from mrtpo.training.rollouts import generate_rollouts
    from mrtpo.training.trainer import Trainer

    warm_start(args.cache_dir)
    argv = ["train", *SETTINGS, "--algo", "mrtpo", "--seed", str(args.seed), "--steps", "1",
            "--out", str(args.out / "trainer"), "--overwrite",
            "--cache-dir", args.cache_dir]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    tr = Trainer(cfg)
    examples = [tr.task.train[i] for i in tr.sampler.take(cfg.prompts_per_step)]
    with tr._amp():
        ro = generate_rollouts(tr.model, tr.prompter, tr.task, examples, cfg, tr.device)
    responses = []
    for r in ro.responses:  # cut or extend (repeating its own tokens) to args.tokens
        r = list(r) or [tr.tok.eos_token_id]
        responses.append((r * (args.tokens // len(r) + 1))[: args.tokens])
    return tr, cfg, ro, responses


def profile(args, mask: str, prepared) -> dict:
    import mrtpo.replay.engine as replay_mod
    from mrtpo.replay.engine import _replay_core, _stream_ids
    from mrtpo.replay.mask import replay_mask_from_rewards

    tr, cfg, ro, responses = prepared
    k = tr.k
    has_info = torch.tensor([[len(s) > 0 for s in row] for row in ro.spans], dtype=torch.bool)
    keep = None
    if mask == "rewards":
        keep = replay_mask_from_rewards(ro.rewards, ro.group_ids, has_info=has_info).tolist()
    texts = [ex.prompt for ex in ro.examples]
    streams = _stream_ids(texts, [list(row) for row in ro.spans],
                          lambda t: tr.prompter.encode(t).ids)  # fmt: skip
    full = [list(p) for p in ro.prompt_ids]
    lcp = []
    for f, row in zip(full, streams):
        for q in row:
            if q is not None:
                n = next((i for i, (a, b) in enumerate(zip(f, q)) if a != b), min(len(f), len(q)))
                lcp.append(len(q) - min(n, len(q) - 1))
    kw = dict(num_streams=k, pad_id=tr.tok.pad_token_id, temperature=cfg.temperature,
              micro_batch=cfg.micro_batch * 2, keep_hidden=True, keep=keep)  # fmt: skip
    runs = {"old": [], "new": []}
    out = {}
    for rep in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, reuse in (("old", False), ("new", True)):
            with tr._amp(), torch.no_grad(), _Timer(replay_mod) as timer:
                t = time.perf_counter()
                core = _replay_core(tr.model, full, streams, responses, reuse=reuse, **kw)
                total = time.perf_counter() - t
            if rep:
                runs[name].append({**timer.sec, "total": total})
            out[name] = core
    diff = (out["new"].distance - out["old"].distance).abs().max().item()
    with tr._amp(), torch.no_grad():  # bf16's own spread: the old path, other row chunks
        other = _replay_core(tr.model, full, streams, responses, reuse=False,
                             **dict(kw, micro_batch=max(1, len(responses) // 2)))  # fmt: skip
    floor = (other.distance - out["old"].distance).abs().max().item()
    with torch.no_grad():  # and in fp32, without autocast
        f_old = _replay_core(tr.model, full, streams, responses, reuse=False, **kw)
        f_new = _replay_core(tr.model, full, streams, responses, reuse=True, **kw)
    diff32 = (f_new.distance - f_old.distance).abs().max().item()
    summary = {
        name: {p: statistics.median(r[p] for r in rs) for p in (*PARTS, "total")}
        for name, rs in runs.items()
    }
    pairs = int(has_info.sum()) if keep is None else int(sum(map(sum, keep)))
    return dict(
        mask=mask, summary=summary, runs=runs, max_abs_distance_diff=diff, pairs=pairs,
        bf16_batching_spread=floor, fp32_max_abs_distance_diff=diff32,
        replayed_rows=out["new"].replayed, prompt_tokens=[len(f) for f in full],
        suffix_tokens=sorted(lcp), tokens=args.tokens, n_rows=len(responses), k=k,
    )  # fmt: skip


def write_record(args, results: list, load_before: str, load_after: str) -> None:
    lines = [
        "# The replay of one K = 4 batch by part: whole prompts without spans vs prefix reuse",
        "",
        "Command (from the checkout root, one thread):",
        "",
        "```",
        f"PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.replay_profile --tokens {args.tokens} "
        f"--repeats {args.repeats} --mask {args.mask} --seed {args.seed} --out {args.out} "
        f"--record {args.record}",
        "```",
        "",
        f"Load before: `{load_before}`  ",
        f"Load after: `{load_after}`",
        "",
        "Old (`reuse=False`): every replay unit runs its whole prompt without spans; one JS "
        "over every row and reward with a kept pair. New (`reuse=True`): a unit starts from "
        "the full prompt's key/value cache at their common token prefix; the JS runs per "
        "group of rows with the same kept rewards. The with-information forward and the "
        "old log-probs are the same code in both columns. Seconds, median of "
        f"{args.repeats} rounds, old and new alternating in one process (a first round not "
        "counted). Numbers from a loaded shared machine: read the ratios, not the seconds.",
        "",
    ]
    names = {"with_info": "with-information forward", "old_logprobs": "old log-probs",
             "units": "unit forwards (prompts without spans)", "js": "fused JS",
             "total": "whole replay"}  # fmt: skip
    for res in results:
        s, sfx = res["summary"], res["suffix_tokens"]
        lines += [
            f"## Mask `{res['mask']}`: {res['pairs']} (response, reward) pairs replayed",
            "",
            f"Batch: issue 25's K = 4 settings (SmolLM2-135M-Instruct warm-started, "
            f"constraints-real, bfloat16 autocast), {res['n_rows']} responses of "
            f"{res['tokens']} tokens, K = {res['k']}, prompts of "
            f"{sorted(set(res['prompt_tokens']))} tokens; {res['replayed_rows']} unit rows "
            f"forwarded. Prompt tokens a unit runs with prefix reuse, per (response, reward): "
            f"median {statistics.median(sfx) if sfx else 0} (range {min(sfx, default=0)}-"
            f"{max(sfx, default=0)}).",
            "",
            "| part | old (reuse=False) | new (reuse=True) | new / old |",
            "|---|---:|---:|---:|",
        ]
        for p in (*PARTS, "total"):
            o, n = s["old"][p], s["new"][p]
            r = n / o if o else float("nan")
            lines.append(f"| {names[p]} | {o:.3f} | {n:.3f} | {r:.2f} |")
        lines += [
            "",
            f"Largest |relevance new - old|: {res['fp32_max_abs_distance_diff']:.1e} in fp32 "
            f"(no autocast); {res['max_abs_distance_diff']:.1e} under bf16 autocast, where "
            f"the old path alone, its rows in other chunks, moves it by "
            f"{res['bf16_batching_spread']:.1e} (bf16 rounding: the distance is the square "
            "root of a small divergence).",
            "",
        ]
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per response")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--mask",
        default="none,rewards",
        help="comma-separated: none (every pair with spans), rewards (A_k != 0 pairs only)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/replay-profile"))
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--record", type=Path, required=True, help="the Markdown file to write")
    args = ap.parse_args(argv)
    for name in ("tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected a positive int, got {getattr(args, name)}")
    masks = args.mask.split(",")
    if not masks or any(m not in ("none", "rewards") for m in masks):
        raise ValueError(f"--mask: expected none and/or rewards, comma-separated, got {args.mask}")
    torch.set_num_threads(1)
    load_before = uptime()
    prepared = batch(args)
    results = [profile(args, m, prepared) for m in masks]
    load_after = uptime()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    write_record(args, results, load_before, load_after)
    print(args.record.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

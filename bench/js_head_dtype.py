"""The replay's JS on the CPU with the LM head in fp32 and in bf16 (autocast), side by side in
one process: what the bf16-operand logits GEMM (``MRTPO_CPU_BF16_GEMM``) buys.

Shapes of issue 25's K = 4 replay by default (SmolLM2-135M-Instruct's head: V = 49152,
d = 576; 256 response tokens, K = 2 kept streams, one JS group), random hidden states and
head (the cost depends on the shapes; the error on the values, so a scale near the model's is
used). Three ways, alternating ``--repeats`` times, one thread:

- ``fp32``: hidden states and head in fp32 (the replay before the head followed autocast);
- ``bf16, fp32 GEMM``: bf16 operands, ``MRTPO_CPU_BF16_GEMM=0`` (upcast copies, fp32 GEMM);
- ``bf16, bf16 GEMM``: bf16 operands, ``MRTPO_CPU_BF16_GEMM=1`` (oneDNN's bf16 GEMM, fp32
  accumulation and logits: what the replay runs under ``--autocast bfloat16``).

Each distance is compared with the float64 reference of its own operands, and the bf16 ways
with the fp32 way (the rounding of the operands to bf16, which autocast does to the model's
own head).

``--replay N`` adds the whole replay: ``mrtpo.replay.engine._replay_core`` on one rollout of issue
25's K = 4 settings (``bench.replay_profile.batch``: SmolLM2-135M-Instruct warm-started,
bf16 autocast, responses of 32 tokens, only the pairs whose advantage is not 0), with the
JS's head in fp32 (``_js_head`` as before this change) and as autocast gives it, alternating
N times in one process.

    python -m bench.js_head_dtype --replay 6 --record bench/results/cpu-bf16-logits-DATE.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


WAYS = ("fp32", "bf16, fp32 GEMM", "bf16, bf16 GEMM")


def operands(n: int, k: int, d: int, v: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(n, d, generator=g) * 2.0
    hq = hp + 0.7 * torch.randn(k, n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.06
    return hp, hq, w


def run(args) -> dict:
    from mrtpo_kernels import chunk_plan, linear_js_distance
    from mrtpo_kernels.reference import js_distance_ref

    hp, hq, w = operands(args.tokens, args.streams, args.d, args.vocab, args.seed)
    low = [t.to(torch.bfloat16) for t in (hp, hq, w)]
    calls = {
        "fp32": ("1", (hp, hq, w)),
        "bf16, fp32 GEMM": ("0", low),
        "bf16, bf16 GEMM": ("1", low),
    }
    secs: dict[str, list[float]] = {way: [] for way in WAYS}
    out: dict[str, torch.Tensor] = {}
    before = os.environ.get("MRTPO_CPU_BF16_GEMM")
    try:
        for rep in range(args.repeats + 1):
            for way in WAYS:
                flag, (a, b, c) = calls[way]
                os.environ["MRTPO_CPU_BF16_GEMM"] = flag
                t = time.perf_counter()
                out[way] = linear_js_distance(a, b, c, backend="cpu")
                if rep:  # the first round warms up
                    secs[way].append(time.perf_counter() - t)
    finally:
        if before is None:
            os.environ.pop("MRTPO_CPU_BF16_GEMM", None)
        else:
            os.environ["MRTPO_CPU_BF16_GEMM"] = before

    def ref(a, b, c):
        zp = a.double() @ c.double().t()
        return torch.stack([js_distance_ref(zp, b[j].double() @ c.double().t())
                            for j in range(b.shape[0])])  # fmt: skip

    ref32, ref16 = ref(hp, hq, w), ref(*low)
    err = {
        "fp32": (out["fp32"].double() - ref32).abs().max().item(),
        "bf16, fp32 GEMM": (out["bf16, fp32 GEMM"].double() - ref16).abs().max().item(),
        "bf16, bf16 GEMM": (out["bf16, bf16 GEMM"].double() - ref16).abs().max().item(),
    }
    return {
        "shape": dict(tokens=args.tokens, streams=args.streams, d=args.d, vocab=args.vocab),
        "available": chunk_plan.gemm_path("cpu", "cpu", torch.bfloat16).endswith(
            "bf16-operand logits"
        ),
        "median_s": {way: statistics.median(secs[way]) for way in WAYS},
        "max_err_vs_float64": err,
        "bf16_vs_fp32_max_abs": (out["bf16, bf16 GEMM"] - out["fp32"]).abs().max().item(),
        "bf16_vs_fp32_mean_abs": (out["bf16, bf16 GEMM"] - out["fp32"]).abs().mean().item(),
        "mean_distance": out["fp32"].mean().item(),
        "gemm_ways_max_abs": (out["bf16, bf16 GEMM"] - out["bf16, fp32 GEMM"]).abs().max().item(),
    }


def replay_ab(repeats: int, cache_dir: str, out: Path, seed: int) -> dict:
    """The whole replay with the JS head in fp32 and as autocast gives it, alternating."""
    import mrtpo.replay.engine as replay_mod
    from bench.replay_profile import _Timer, batch
    from mrtpo.replay.engine import _replay_core, _stream_ids
    from mrtpo.replay.mask import replay_mask_from_rewards

    ns = argparse.Namespace(tokens=32, seed=seed, out=out, cache_dir=cache_dir)
    tr, cfg, ro, responses = batch(ns)
    has_info = torch.tensor([[len(s) > 0 for s in row] for row in ro.spans], dtype=torch.bool)
    keep = replay_mask_from_rewards(ro.rewards, ro.group_ids, has_info=has_info).tolist()
    streams = _stream_ids([ex.prompt for ex in ro.examples], [list(r) for r in ro.spans],
                          lambda t: tr.prompter.encode(t).ids)  # fmt: skip
    full = [list(p) for p in ro.prompt_ids]
    kw = dict(num_streams=tr.k, pad_id=tr.tok.pad_token_id, temperature=cfg.temperature,
              micro_batch=cfg.micro_batch * 2, keep=keep)  # fmt: skip
    real = replay_mod._js_head
    ways = {"fp32 head": lambda w, b: (w, b, w.dtype), "autocast head (bf16)": real}
    secs = {name: [] for name in ways}
    try:
        for rep in range(repeats + 1):
            for name, head in ways.items():
                replay_mod._js_head = head
                with tr._amp(), torch.no_grad(), _Timer(replay_mod) as timer:
                    t = time.perf_counter()
                    _replay_core(tr.model, full, streams, responses, **kw)
                    total = time.perf_counter() - t
                if rep:
                    secs[name].append((total, timer.sec["js"]))
    finally:
        replay_mod._js_head = real
    return {
        name: {
            "total": statistics.median(t for t, _ in v),
            "js": statistics.median(j for _, j in v),
        }
        for name, v in secs.items()
    } | {"pairs": int(sum(map(sum, keep))), "rows": len(responses), "repeats": repeats}


def write_record(args, res, load_before, load_after):
    s = res["shape"]
    med = res["median_s"]
    lines = [
        "# The replay's JS on the CPU: LM head in fp32 and in bf16, side by side",
        "",
        "Command (from the checkout root, one thread):",
        "",
        "```",
        f"PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.js_head_dtype --tokens {s['tokens']} "
        f"--streams {s['streams']} --d {s['d']} --vocab {s['vocab']} --repeats {args.repeats} "
        f"--seed {args.seed}"
        + (f" --replay {args.replay}" if args.replay else "")
        + f" --record {args.record}",
        "```",
        "",
        f"Load before: `{load_before}`  ",
        f"Load after: `{load_after}`",
        "",
        f"`linear_js_distance`, one-vs-{s['streams']}: {s['tokens']} tokens, d = {s['d']}, "
        f"V = {s['vocab']} (issue 25's K = 4 replay group on SmolLM2-135M's head), random "
        f"operands; oneDNN bf16 GEMMs on this CPU: {res['available']}. Seconds, median of "
        f"{args.repeats} rounds, the three ways alternating in one process (a first round not "
        "counted). A shared machine: read the ratios.",
        "",
        "| way | seconds | / fp32 | max error vs float64 of its operands |",
        "|---|---:|---:|---:|",
    ]
    for way in WAYS:
        lines.append(f"| {way} | {med[way]:.3f} | {med[way] / med['fp32']:.2f} | "
                     f"{res['max_err_vs_float64'][way]:.1e} |")  # fmt: skip
    lines += [
        "",
        f"- bf16 GEMM against fp32 GEMM on the same bf16 operands: largest |difference| "
        f"{res['gemm_ways_max_abs']:.1e} (the order of fp32 accumulation).",
        f"- bf16 operands against fp32 ones (the rounding autocast applies to the model's own "
        f"head): largest |difference| {res['bf16_vs_fp32_max_abs']:.1e}, mean "
        f"{res['bf16_vs_fp32_mean_abs']:.1e}, against a mean distance of "
        f"{res['mean_distance']:.3f}.",
        "",
    ]
    rep = res.get("replay")
    if rep:
        a, b = rep["fp32 head"], rep["autocast head (bf16)"]
        lines += [
            "## The whole replay",
            "",
            f"One rollout of issue 25's K = 4 settings ({rep['rows']} responses of 32 tokens, "
            f"{rep['pairs']} pairs whose advantage is not 0 replayed, bf16 autocast), "
            f"`_replay_core` with the JS head in fp32 and as autocast gives it, alternating "
            f"{rep['repeats']} times (a first round not counted); seconds, medians.",
            "",
            "| part | fp32 head | autocast head (bf16) | ratio |",
            "|---|---:|---:|---:|",
            f"| fused JS | {a['js']:.3f} | {b['js']:.3f} | {b['js'] / a['js']:.2f} |",
            f"| whole replay | {a['total']:.3f} | {b['total']:.3f} | "
            f"{b['total'] / a['total']:.2f} |",
            "",
        ]
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--replay",
        type=int,
        default=0,
        help="also time the whole K = 4 replay, alternating this many times",
    )
    ap.add_argument("--cache-dir", default="runs/cache", help="where built-in models are cached")
    ap.add_argument("--out", type=Path, default=Path("runs/js-head-dtype"))
    ap.add_argument("--record", type=Path, required=True, help="the Markdown file to write")
    args = ap.parse_args(argv)
    if args.replay < 0:
        raise ValueError(f"--replay: expected an int >= 0, got {args.replay}")
    for name in ("tokens", "streams", "d", "vocab", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected a positive int, got {getattr(args, name)}")
    torch.set_num_threads(1)
    load_before = uptime()
    res = run(args)
    if args.replay:
        res["replay"] = replay_ab(args.replay, args.cache_dir, args.out, args.seed)
    load_after = uptime()
    write_record(args, res, load_before, load_after)
    print(args.record.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak memory of the teacher-forced forward after a shared prompt cache at long responses:
the responses in one piece (the 2-D attention mask over prompt + response, what the replay
did before) against pieces of at most ``--piece`` tokens (issue 33 item 2).

Each case runs ``mrtpo.replay.teacher_forcing.forward_shared_prompts`` in a fresh process (one
thread, glibc's mmap threshold at 256 KiB so that freed tensors leave the RSS) on a small
built-in Qwen2 shape (d = 64, 2 layers: the attention's (rows, R, P + R) terms dominate, not
the weights), 4 rows of ``--tokens`` random tokens after two prompts, of the same length or
of two lengths (left padding: the mask is needed). Peak RSS (VmHWM) minus the RSS before
the forward; the hidden states of the two ways are compared.

    PYTHONPATH=. python -m bench.tail_memory --tokens 8192 --record bench/results/DATE.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ONE_PIECE = 1 << 30


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(piece: int, tokens: int, mixed: bool, out: Path) -> None:
    import time

    import torch

    from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer
    from mrtpo.replay.teacher_forcing import forward_shared_prompts

    torch.set_num_threads(1)
    tok = build_tokenizer(["hello world owls blue rain gold"] * 8, vocab_size=300)
    cfg = TinyConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=2, num_kv_heads=1)  # fmt: skip
    model = build_tiny_model(tok, cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    p1 = torch.randint(10, len(tok) - 1, (60,), generator=g).tolist()
    p2 = p1[:50] if mixed else p1
    responses = [torch.randint(10, len(tok) - 1, (tokens,), generator=g).tolist()
                 for _ in range(4)]  # fmt: skip
    before = _hwm_mib()
    t = time.perf_counter()
    h = forward_shared_prompts(model, [p1, p1, p2, p2], responses, tok.pad_token_id,
                               micro_batch=8, device="cpu", max_piece=piece)  # fmt: skip
    sec = time.perf_counter() - t
    torch.save(h, out.with_suffix(".pt"))
    out.write_text(json.dumps(dict(peak_mib=_hwm_mib() - before, seconds=sec)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--piece", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("runs/tail-memory"))
    ap.add_argument("--record", type=Path, required=True, help="the Markdown file to write")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(int(args.child[0]), args.tokens, args.child[1] == "mixed", Path(args.child[2]))
        return 0
    for name in ("tokens", "piece"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected a positive int, got {getattr(args, name)}")
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="262144")
    rows = []
    for prompts in ("same", "mixed"):
        res = {}
        for label, piece in (("one piece", ONE_PIECE), (f"pieces of {args.piece}", args.piece)):
            out = args.out / f"{prompts}-{piece}.json"
            cmd = [sys.executable, "-m", "bench.tail_memory", "--tokens", str(args.tokens),
                   "--record", str(args.record), "--child", str(piece), prompts,
                   str(out)]  # fmt: skip
            subprocess.run(cmd, env=env, check=True)
            res[label] = json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))
        (a, ha), (b, hb) = res.values()
        diff = (ha - hb).abs().max().item()
        rows.append((prompts, a, b, diff))
    lines = [
        "# Teacher-forced responses after a prompt cache: one piece vs bounded pieces",
        "",
        "```",
        f"PYTHONPATH=. python -m bench.tail_memory --tokens {args.tokens} --piece {args.piece} "
        f"--out {args.out} --record {args.record}",
        "```",
        "",
        f"4 rows of {args.tokens} tokens after 2 prompts (60 tokens; `mixed`: 60 and 50, left "
        "padding), a d = 64, 2-layer Qwen2 shape, one thread, fp32. Peak RSS above the RSS "
        "before the forward (each case in a fresh process). One piece with `mixed` prompts "
        "is what the replay's forwards did before (the response whole, a 2-D mask always); "
        "with `same` prompts no mask is passed now, yet one piece still forms the "
        "(R, P + R) attention terms.",
        "",
        f"| prompts | one piece: MiB, s | pieces of {args.piece}: MiB, s | max abs hidden diff |",
        "|---|---:|---:|---:|",
    ]
    for prompts, a, b, diff in rows:
        lines.append(f"| {prompts} | {a['peak_mib']:.0f}, {a['seconds']:.1f} | "
                     f"{b['peak_mib']:.0f}, {b['seconds']:.1f} | {diff:.1e} |")  # fmt: skip
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

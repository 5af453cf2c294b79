"""A small CPU demo of the MRTPO credit-assignment step on synthetic data.

Two prompts x three rollouts, two rewards: "correct" reads no prompt span (uniform credit)
and "keyword" checks one constraint sentence. The hidden states with and without that
sentence differ only on the tokens where the keyword is written, so the JS relevance
(computed by the fused op through a Qwen-sized LM head slice) singles them out, and the
keyword reward's advantage is reallocated there while each response keeps its total.
"""

from __future__ import annotations

import argparse
import time

import torch

import mrtpo_kernels as mk

TOKENS = ["The", "answer", "uses", "the", "word", "<kw>", "as", "asked", "."]
KEYWORD_POS = 5


def build(seed: int = 0, vocab: int = 32000, dim: int = 64):
    g = torch.Generator().manual_seed(seed)
    n_prompts, group, t = 2, 3, len(TOKENS)
    n = n_prompts * group
    weight = torch.randn(vocab, dim, generator=g) / dim**0.5
    hidden_p = torch.randn(n, t, dim, generator=g) * 2.0
    hidden_q = hidden_p.clone()  # without the keyword sentence: only the keyword differs
    hidden_q[:, KEYWORD_POS] += 3.0 * torch.randn(n, dim, generator=g)
    hidden_q[:, KEYWORD_POS + 1] += 0.8 * torch.randn(n, dim, generator=g)
    hidden_q += 0.05 * torch.randn(hidden_q.shape, generator=g)
    # rewards: [correct, keyword]; the keyword reward varies within each group
    rewards = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1], [0, 0], [1, 0]], dtype=torch.float32)
    group_ids = torch.arange(n_prompts).repeat_interleave(group)
    has_info = torch.tensor([[False, True]] * n)
    return weight, hidden_p, hidden_q, rewards, group_ids, has_info


def run(seed: int = 0, vocab: int = 32000) -> dict:
    weight, hp, hq, rewards, group_ids, has_info = build(seed, vocab)
    n, t, dim = hp.shape
    start = time.perf_counter()
    # K = 1 replayed reward here (the keyword); the "correct" reward has no span to remove
    d_kw = mk.linear_js_distance(hp.reshape(n * t, dim), hq.reshape(1, n * t, dim), weight)
    relevance = torch.zeros(2, n, t)
    relevance[1] = d_kw.view(n, t)
    mask = torch.ones(n, t, dtype=torch.bool)
    adv = mk.mrtpo_token_advantages(
        rewards, group_ids, relevance, has_info=has_info, response_mask=mask
    )
    elapsed = time.perf_counter() - start
    return {"relevance": relevance, "adv": adv, "rewards": rewards, "seconds": elapsed}


def format_table(out: dict) -> str:
    rel, adv, rewards = out["relevance"], out["adv"], out["rewards"]
    n, t = adv.token.shape
    lines = []
    w = max(len(s) for s in TOKENS) + 2
    for i in range(n):
        r = rewards[i].tolist()
        lines.append(
            f"response {i}  rewards correct={r[0]:.0f} keyword={r[1]:.0f}  "
            f"GDPO advantage {adv.sequence[i]:+.3f}"
        )
        lines.append("  " + "token".ljust(w) + "JS(keyword)  weight(keyword)  token advantage")
        for j in range(t):
            lines.append(
                "  " + TOKENS[j].ljust(w) + f"{rel[1, i, j]:11.4f}  {adv.allocation[1, i, j]:15.3f}"
                f"  {adv.token[i, j]:+15.3f}"
            )
        total = adv.token[i].sum().item()
        lines.append(
            f"  sum of token advantages {total:+.3f} = T x GDPO advantage "
            f"{t * adv.sequence[i].item():+.3f}"
        )
        lines.append("")
    return "\n".join(lines)


MAX_VOCAB = 2**20  # LM head rows: 2^20 x 64 float32 is 256 MiB, past every real vocabulary


def _int_in(lo: int, hi: int, why: str = ""):
    """An argparse type: an integer in [lo, hi] (checked on its digits first, so that a
    huge one is named, not printed), else an error saying so."""

    def parse(text: str) -> int:
        want = f"expected an integer in [{lo}, {hi}]{why}"
        digits = text.strip().lstrip("+-").lstrip("0")
        if len(digits) > 60 and digits.isascii() and digits.isdigit():
            raise argparse.ArgumentTypeError(f"{want}, got an integer of {len(digits)} digits")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{want}, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{want}, got {value}")
        return value

    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mrtpo demo", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seed",
        type=_int_in(0, 2**63 - 1, " (an int64, as torch's seeds)"),
        default=0,
        help="random seed, 0 to 2^63 - 1 (default 0)",
    )
    ap.add_argument(
        "--vocab",
        type=_int_in(2, MAX_VOCAB),
        default=32000,
        help=f"LM head rows, 2 to {MAX_VOCAB} (default 32000)",
    )
    args = ap.parse_args(argv)
    out = run(args.seed, args.vocab)
    print(format_table(out))
    backends = {k: v for k, v in mk.backend_status().items() if v == "ok"}
    print(
        f"JS relevance + token advantages in {out['seconds'] * 1e3:.1f} ms on the CPU "
        f"(backends available: {', '.join(backends)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

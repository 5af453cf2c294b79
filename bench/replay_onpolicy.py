"""MRTPO's on-policy replay on one fixed K = 4 real-model batch, timed as ``mrtpo train``
runs it (issue 43): the update's forwards first (``Trainer._update_forwards``: the
with-information hidden states and the prompts' key/value caches), then
``contrastive_replay`` on the pairs whose GDPO advantage is not 0, taking both. Only the
replay is timed; the update's forwards are run again before each repeat (their caches and
hidden states are the replay's input).

``--region shared`` (the trainer from 4ae74b8 on): the update's forwards and the replay in
one autocast region, so the replay reuses the weights' bf16 copies that autocast made for
the update's forwards; ``separate``: the replay in its own region (one more cast of the
weights), as before. The script uses only what the trainer had at 89ce3b0, so the same file
run with ``PYTHONPATH`` at an older checkout times that checkout's replay:

    python -m bench.replay_onpolicy --region shared --out runs/replay-onpolicy
    (cd OLD_CHECKOUT && PYTHONPATH=. python NEW_CHECKOUT/bench/replay_onpolicy.py \\
        --region separate --out runs/replay-onpolicy --cache-dir NEW_CHECKOUT/runs/cache)

Prints one JSON line: the commit, pairs replayed, the median and min seconds over
``--repeats`` (after one warm-up), and seconds per replayed pair.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch


def replay_times(tr, cfg, ro, *, region: str, repeats: int) -> dict:
    """Time the on-policy replay ``repeats`` times after one warm-up (see the module)."""
    from mrtpo.replay.api import contrastive_replay, replay_mask_from_rewards
    from mrtpo.replay.relevance_modes import step_mode

    if region not in ("shared", "separate"):
        raise ValueError(f"region: expected 'shared' or 'separate', got {region!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive int, got {repeats!r}")
    has_info = torch.tensor([[len(s) > 0 for s in row] for row in ro.spans], dtype=torch.bool)
    mode = step_mode(cfg.algo, cfg.relevance)
    moving = replay_mask_from_rewards(
        ro.rewards, ro.group_ids, has_info=has_info, whole_rows=mode.mixes_rewards
    )
    times, rep = [], None
    for i in range(repeats + 1):
        outer = tr._amp() if region == "shared" else contextlib.nullcontext()
        with outer:
            _, hp, caches = tr._update_forwards(ro)
            t = time.perf_counter()
            with tr._amp():
                rep = contrastive_replay(
                    tr.model, tr.prompter, [ex.prompt for ex in ro.examples], ro.prompt_ids,
                    ro.responses, ro.spans, temperature=cfg.temperature,
                    micro_batch=cfg.micro_batch * 2, replay=True,
                    control=mode.control_spans(ro.examples, ro.spans),
                    pointwise=mode.pointwise, replay_mask=moving, old_logprobs=False,
                    hidden_p=hp, prompt_caches=caches,
                )  # fmt: skip
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {
        "region": region,
        "pairs": rep.replayed,
        "median_s": round(med, 4),
        "min_s": round(min(times), 4),
        "s_per_pair": round(med / rep.replayed, 5) if rep.replayed else None,
        "relevance": rep.relevance,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay_onpolicy", description=__doc__)
    ap.add_argument("--region", choices=("shared", "separate"), default="shared")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/replay-onpolicy"))
    ap.add_argument("--cache-dir", default="runs/cache")
    args = ap.parse_args(argv)
    from bench.replay_profile import batch

    torch.set_num_threads(1)
    tr, cfg, ro, _ = batch(argparse.Namespace(tokens=32, seed=args.seed, out=args.out,
                                              cache_dir=args.cache_dir))  # fmt: skip
    row = replay_times(tr, cfg, ro, region=args.region, repeats=args.repeats)
    row.pop("relevance")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit, **row, "load": uptime}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

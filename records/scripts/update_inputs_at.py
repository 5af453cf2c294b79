"""Rerun a recorded run's first STEP steps (same settings, its thread count) and print, at
the last one, each response's rewards, S = sum_k A_k and token-advantage range: how a
grad-norm spike in a run's metrics is traced to its advantages.

    python records/scripts/update_inputs_at.py RECORDED_RUN STEP [--save FILE.pt]

The rerun's grad norms are printed beside the recorded ones (equal when the code and the
settings reproduce the run). --save keeps the rollout, old log-probs and advantages.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from mrtpo.training.config import TrainConfig
from mrtpo.training.trainer import Trainer


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recorded", type=Path)
    ap.add_argument("step", type=int)
    ap.add_argument("--save", type=Path, default=None)
    args = ap.parse_args()
    d = json.loads((args.recorded / "config.json").read_text())
    rec = [json.loads(x) for x in (args.recorded / "metrics.jsonl").read_text().splitlines()]
    out = tempfile.mkdtemp(prefix="update-inputs-")
    d.update(out=out, overwrite=True, resume=False, steps=args.step)
    if d.get("threads"):
        torch.set_num_threads(d["threads"])
    tr = Trainer(TrainConfig.from_dict(d))
    seen = {}
    update = tr._update

    def keep(ro, old_logp, adv, ref_logp, lengths):
        seen.update(ro=ro, old_logp=old_logp, adv=adv, lengths=lengths)
        return update(ro, old_logp, adv, ref_logp, lengths)

    tr._update = keep
    for s in range(args.step):
        row = tr.train_step()
        print(
            f"step {s + 1}: grad norm {row['grad_norm']:.4g} (recorded {rec[s]['grad_norm']:.4g})"
        )
    ro, adv, lengths = seen["ro"], seen["adv"], seen["lengths"]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    for i in range(len(lengths)):
        a = adv[cu[i] : cu[i + 1]]
        r = [float(x) for x in ro.rewards[i]]
        print(f"response {i}: rewards {r} token advantages {a.min():.4g} .. {a.max():.4g}")
    if args.save is not None:
        torch.save({k: (v.__dict__ if k == "ro" else v) for k, v in seen.items()}, args.save)


if __name__ == "__main__":
    main()

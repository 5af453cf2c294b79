"""Starting pass rates of a built-in pretrained model on a task, after an optional warm
start: G samples for each of P training prompts, per reward pass rate, the share of answers
cut at the token cap, and a few answers.

    python records/scripts/real_calibration.py --task constraints-real \
        --warm-steps 40 --warm-noise 0.5 --prompts 16 --group 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mrtpo.model.initial import initial_folder
from mrtpo.model.loading import load_model
from mrtpo.replay.prompting import ChatPrompter
from mrtpo.tasks.builtin import load_task
from mrtpo.training.config import TrainConfig
from mrtpo.training.rollouts import generate_rollouts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--task", default="constraints-real")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-steps", type=int, default=0)
    ap.add_argument("--warm-noise", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=4)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    task = load_task(a.task, seed=a.seed)
    t0 = time.perf_counter()
    folder = initial_folder(
        a.model,
        task,
        seed=a.seed,
        cache_dir=a.cache_dir,
        warm_steps=a.warm_steps,
        warm_noise=a.warm_noise,
        dtype=a.dtype,
        log=print,
    )
    t_warm = time.perf_counter() - t0
    model, tok = load_model(folder, dtype=getattr(torch, a.dtype))
    cfg = TrainConfig(
        task=a.task,
        group_size=a.group,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        out="unused",
    )
    torch.manual_seed(a.seed)
    t1 = time.perf_counter()
    ro = generate_rollouts(model, ChatPrompter(tok), task, task.train[: a.prompts], cfg, "cpu")
    t_gen = time.perf_counter() - t1
    passed = (ro.rewards >= 1 - 1e-6).float()
    names = [v.name for v in task.verifiers]
    out = {
        "model": a.model,
        "task": a.task,
        "warm_steps": a.warm_steps,
        "warm_noise": a.warm_noise,
        "responses": len(ro.texts),
        "pass": {n: round(float(passed[:, j].mean()), 3) for j, n in enumerate(names)},
        "all_pass": round(float(passed.all(1).float().mean()), 3),
        "truncated": round(sum(ro.truncated) / len(ro.truncated), 3),
        "mean_len": round(sum(map(len, ro.responses)) / len(ro.responses), 1),
        "seconds": {"warm": round(t_warm, 1), "generate": round(t_gen, 1)},
    }
    for i in range(0, min(len(ro.texts), a.show * a.group), a.group):
        print(repr(ro.texts[i][:160]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

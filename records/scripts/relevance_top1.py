"""Issue 11 diagnostic: how often each relevance form puts its largest value of a response
on a token the reward's verifier names (noisy constraints test-bed, 64 prompts x 8).
Run: .venv/bin/python records/scripts/relevance_top1.py (seconds once the warm-started
model is cached)."""

import torch

from mrtpo.model.loading import default_model
from mrtpo.replay.api import contrastive_replay
from mrtpo.replay.prompting import ChatPrompter
from mrtpo.tasks.builtin import load_task
from mrtpo.training.config import TinyConfig, TrainConfig
from mrtpo.training.metrics import relevant_token_masks
from mrtpo.training.rollouts import generate_rollouts
from mrtpo_kernels import specific_relevance

torch.set_num_threads(2)
task = load_task("constraints", seed=0)
model, tok = default_model(task, seed=0, cfg=TinyConfig(warm_steps=500, warm_noise=0.5))
pr = ChatPrompter(tok)
cfg = TrainConfig(task="constraints", group_size=8)
torch.manual_seed(0)
hits = {m: [[0, 0] for _ in range(3)] for m in ["js", "specific", "logratio"]}
chance = [[0.0, 0] for _ in range(3)]  # a uniformly drawn token: |relevant| / T
for i in range(0, 64, 8):
    ro = generate_rollouts(model, pr, task, list(task.train)[i : i + 8], cfg, "cpu")
    rep = contrastive_replay(
        model,
        pr,
        [e.prompt for e in ro.examples],
        ro.prompt_ids,
        ro.responses,
        ro.spans,
        temperature=1.0,
        pointwise=True,
    )
    lengths = torch.tensor([len(r) for r in ro.responses])
    has = torch.tensor([[len(s) > 0 for s in row] for row in ro.spans])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rels = {
        "js": rep.relevance,
        "specific": specific_relevance(rep.relevance, has, cu_seqlens=cu),
        "logratio": rep.logratio,
    }
    masks = relevant_token_masks(task, ro)
    for r in range(len(lengths)):
        a, b = int(cu[r]), int(cu[r + 1])
        for k in range(3):
            m = masks[r][k]
            if m is None or not has[r, k]:
                continue
            m = m[: b - a]
            if m.sum() == 0 or m.sum() == b - a:
                continue
            chance[k][0] += float(m.float().mean())
            chance[k][1] += 1
            for name, rel in rels.items():
                t = int(rel[k, a:b].argmax())
                h = hits[name][k]
                h[0] += bool(m[t])
                h[1] += 1
names = [v.name for v in task.verifiers]
print("chance", " ".join(f"{names[k]} {c[0] / max(c[1], 1):.2f}" for k, c in enumerate(chance)))
for name, hs in hits.items():
    print(
        name,
        " ".join(
            f"{names[k]} top1-hit {h[0] / max(h[1], 1):.2f} (n={h[1]})" for k, h in enumerate(hs)
        ),
    )

"""The MRTPO training loop: rollouts, rewards, contrastive replay, advantages, the fused
clipped policy loss, AdamW, checkpoints and metrics. Uses only the public API of
mrtpo_kernels.

One step:
1. B prompts; G sampled responses each with ``generate`` (temperature, no top-k/top-p by
   default), cut after the first end-of-turn token.
2. Every verifier scores every response: rewards (n, K) and each verdict's prompt spans.
3. Contrastive replay (``mrtpo.replay``): the with-information forward gives the old
   log-probs; the forwards without each reward's spans give the relevance d (K, N).
4. Advantages: ``grpo`` (the summed reward through ``gdpo_advantages`` with K = 1, uniform
   over tokens), ``gdpo`` (``gdpo_advantages``, uniform), ``mrtpo``
   (``mrtpo_token_advantages``, packed with cu_seqlens).
5. PPO epochs over minibatches of responses, micro-batches accumulated, loss =
   ``linear_policy_loss`` on the policy's hidden states and LM head (optional k3 KL to the
   initial model), gradient-norm clipping, AdamW.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from mrtpo_kernels import (
    gdpo_advantages,
    linear_logprobs,
    linear_policy_loss,
    mrtpo_token_advantages,
)

from .model import (
    ChatPrompter,
    TinyConfig,
    default_model,
    lm_head,
    load_model,
    response_offsets,
    save_model,
    spans_to_token_mask,
)
from .replay import contrastive_replay, forward_responses, response_hidden, teacher_batch

ALGOS = ("grpo", "gdpo", "mrtpo")
TASKS = ("constraints", "sql", "tools")
PASS_THRESHOLD = 1.0 - 1e-6


@dataclass
class TrainConfig:
    """Every knob of a training run (the CLI exposes each as a flag)."""

    task: str = "constraints"
    algo: str = "mrtpo"
    model: str | None = None  # a local HF causal LM folder; None: the built-in tiny model
    steps: int = 30
    seed: int = 0
    init_seed: int | None = None  # seed of the task data and built-in warm start (None: seed)
    out: str = "runs/train"
    resume: bool = False
    prompts_per_step: int = 8  # B
    group_size: int = 8  # G
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    lr: float = 2e-4
    weight_decay: float = 0.0
    ppo_epochs: int = 1
    minibatches: int = 1
    micro_batch: int = 16  # responses per forward (gradient accumulation inside a minibatch)
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    alpha: float = 1.0
    gamma: float = 1.0
    batch_norm: str = "sequence"
    kl_beta: float = 0.0
    replay_for_baselines: bool = True  # also measure relevance under grpo/gdpo (logging only)
    checkpoint_every: int = 10
    html_samples: int = 8
    device: str = "auto"
    dtype: str = "float32"
    cache_dir: str = "runs/cache"
    tiny: TinyConfig = field(default_factory=TinyConfig)

    def validate(self) -> TrainConfig:
        def bad(name, msg):
            raise ValueError(f"{name}: {msg}")

        if self.algo not in ALGOS:
            bad("algo", f"expected one of {', '.join(ALGOS)}, got {self.algo!r}")
        if self.batch_norm not in ("sequence", "token"):
            bad("batch_norm", f"expected 'sequence' or 'token', got {self.batch_norm!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            bad("dtype", f"expected float32, bfloat16 or float16, got {self.dtype!r}")
        for name in (
            "steps",
            "prompts_per_step",
            "max_new_tokens",
            "ppo_epochs",
            "minibatches",
            "micro_batch",
            "checkpoint_every",
        ):
            if int(getattr(self, name)) < 1:
                bad(name, f"expected a positive integer, got {getattr(self, name)}")
        if self.group_size < 2:
            bad("group_size", f"expected at least 2 rollouts per prompt, got {self.group_size}")
        if self.minibatches > self.prompts_per_step * self.group_size:
            bad("minibatches", "expected at most one minibatch per response")
        for name in ("temperature", "lr"):
            v = float(getattr(self, name))
            if not (v > 0 and math.isfinite(v)):
                bad(name, f"expected a positive number, got {v}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"expected a number in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"expected 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.alpha <= 1.0:
            bad("alpha", f"expected a number in [0, 1], got {self.alpha}")
        for name in ("gamma",):
            if not getattr(self, name) > 0:
                bad(name, f"expected a positive number, got {getattr(self, name)}")
        for name in ("clip_low", "clip_high", "kl_beta", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                bad(name, f"expected a non-negative number, got {getattr(self, name)}")
        if self.model is not None and not Path(self.model).is_dir():
            bad("model", f"{self.model!r} is not a folder with a saved Hugging Face causal LM")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d)
        if isinstance(d.get("tiny"), dict):
            d["tiny"] = TinyConfig(**d["tiny"])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------------------------
# Seeds and devices


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return dev


# --------------------------------------------------------------------------------------------
# Rollouts


class PromptSampler:
    """Cycles through the training examples in a seeded shuffled order (picklable state)."""

    def __init__(self, n: int, seed: int):
        if n == 0:
            raise ValueError("task: it has no training examples")
        self.n = n
        self.rng = random.Random(seed)
        self.queue: list[int] = []

    def take(self, b: int) -> list[int]:
        out = []
        while len(out) < b:
            if not self.queue:
                self.queue = list(range(self.n))
                self.rng.shuffle(self.queue)
            out.append(self.queue.pop())
        return out

    def state(self):
        return {"rng": self.rng.getstate(), "queue": list(self.queue)}

    def load(self, state):
        self.rng.setstate(state["rng"])
        self.queue = list(state["queue"])


@dataclass
class Rollouts:
    examples: list  # (n,) Example of each response
    group_ids: torch.Tensor  # (n,)
    prompt_ids: list[list[int]]
    responses: list[list[int]]  # token ids, end-of-turn included when generated
    texts: list[str]
    offsets: list[list[tuple[int, int]]]  # response token character ranges in texts
    rewards: torch.Tensor  # (n, K) float32
    spans: list[list[tuple]]  # (n, K) prompt spans per verdict
    reasons: list[list[str | None]]


def _stop_ids(tokenizer, model) -> set[int]:
    ids = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids


@torch.no_grad()
def generate_rollouts(model, prompter, task, examples, cfg: TrainConfig, device) -> Rollouts:
    tok = prompter.tokenizer
    enc = [prompter.encode(ex.prompt) for ex in examples]
    width = max(len(e.ids) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e.ids) :] = torch.tensor(e.ids)
        mask[i, width - len(e.ids) :] = 1
    stop = _stop_ids(tok, model)
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=True,
        temperature=cfg.temperature,
        top_k=cfg.top_k,  # 0 switches the top-k filter off (also a model's default one)
        top_p=cfg.top_p,  # 1.0 switches nucleus sampling off
        max_new_tokens=cfg.max_new_tokens,
        num_return_sequences=cfg.group_size,
        pad_token_id=tok.pad_token_id,
        eos_token_id=sorted(stop) if stop else None,
    )
    gen = out[:, width:].tolist()
    n = len(gen)
    rep_examples, prompt_ids, responses, texts, offs = [], [], [], [], []
    rewards, spans, reasons = [], [], []
    for r in range(n):
        ex_i = r // cfg.group_size
        row = gen[r]
        cut = len(row)
        for t, v in enumerate(row):
            if v in stop:
                cut = t + 1
                break
        resp = row[:cut]
        if not resp:
            resp = [next(iter(stop))] if stop else [tok.pad_token_id]
        text, off = response_offsets(tok, resp)
        ex = examples[ex_i]
        verdicts = []
        for v in task.verifiers:
            try:
                verdicts.append(v(ex, text))
            except Exception as err:  # a verifier must not stop training: score 0, logged
                verdicts.append(_failed_verdict(v, err))
        rep_examples.append(ex)
        prompt_ids.append(enc[ex_i].ids)
        responses.append(resp)
        texts.append(text)
        offs.append(off)
        rewards.append([float(v.score) for v in verdicts])
        spans.append([tuple(tuple(s) for s in v.spans) for v in verdicts])
        reasons.append([v.reason for v in verdicts])
    group_ids = torch.arange(len(examples)).repeat_interleave(cfg.group_size)
    return Rollouts(
        rep_examples,
        group_ids,
        prompt_ids,
        responses,
        texts,
        offs,
        torch.tensor(rewards, dtype=torch.float32),
        spans,
        reasons,
    )


def _failed_verdict(verifier, err):
    from .verifiers.base import Verdict

    return Verdict(0.0, (), f"verifier {getattr(verifier, 'name', '?')} raised: {err!r}")


# --------------------------------------------------------------------------------------------
# Advantages and credit precision


def compute_advantages(algo, rewards, group_ids, relevance, has_info, lengths, cfg):
    """Token advantages (N,) packed, and the allocation weights (K, N) actually applied."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    k, n_tok = rewards.shape[1], int(cu[-1])
    uniform = torch.ones((k, n_tok), dtype=torch.float32)
    if algo == "mrtpo":
        ta = mrtpo_token_advantages(
            rewards,
            group_ids,
            relevance,
            has_info=has_info,
            cu_seqlens=cu,
            alpha=cfg.alpha,
            gamma=cfg.gamma,
            batch_norm=cfg.batch_norm,
        )
        return ta.token.float(), ta.allocation.float()
    summed = rewards.sum(1, keepdim=True) if algo == "grpo" else rewards
    g = gdpo_advantages(summed, group_ids, batch_norm=cfg.batch_norm, lengths=lengths)
    return g.sequence.float().repeat_interleave(lengths), uniform


def relevant_token_masks(task, rollouts: Rollouts) -> list[list[torch.Tensor | None]]:
    """(n, K): response tokens each constraint concerns (from the verifier's
    ``relevant_chars``), or None where the verifier does not say."""
    out = []
    for ex, text, off in zip(rollouts.examples, rollouts.texts, rollouts.offsets):
        row = []
        for v in task.verifiers:
            fn = getattr(v, "relevant_chars", None)
            if fn is None:
                row.append(None)
                continue
            try:
                chars = fn(ex, text)
            except Exception:
                chars = None
            row.append(None if chars is None else spans_to_token_mask(off, chars))
        out.append(row)
    return out


def credit_precision(alloc, masks, has_info, lengths):
    """Per reward: mean share of the allocation mass on the relevant tokens, and the share a
    uniform allocation would give (|relevant| / T), over responses where the reward has
    spans and the relevant tokens are a proper, non-empty subset of the response."""
    k = alloc.shape[0]
    starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(lengths, 0)
    prec = [[] for _ in range(k)]
    unif = [[] for _ in range(k)]
    for i in range(len(lengths)):
        a, b = int(starts[i]), int(starts[i + 1])
        for j in range(k):
            m = masks[i][j]
            if m is None or not bool(has_info[i, j]):
                continue
            m = m[: b - a]
            cnt = int(m.sum())
            if cnt == 0 or cnt == b - a:
                continue
            w = alloc[j, a:b].double()
            tot = float(w.sum())
            if tot <= 0:
                continue
            prec[j].append(float(w[m].sum()) / tot)
            unif[j].append(cnt / (b - a))
    mean = lambda xs: (sum(xs) / len(xs)) if xs else None
    return [mean(p) for p in prec], [mean(u) for u in unif], [len(p) for p in prec]


# --------------------------------------------------------------------------------------------
# The trainer


@dataclass
class TrainResult:
    out: Path
    metrics: list[dict]
    metrics_path: Path
    curves_path: Path
    html_path: Path
    checkpoint: Path


def _load_task(name, seed):
    try:
        from .tasks import load_task
    except ImportError as err:
        raise ValueError(f"task: the task registry mrtpo.tasks is not available ({err})") from err
    return load_task(name, seed=seed)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, task=None, log=None):
        self.cfg = cfg.validate()
        self.log = log or (lambda msg: None)
        if task is None:
            if cfg.task not in TASKS:
                raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {cfg.task!r}")
            task = _load_task(cfg.task, cfg.seed if cfg.init_seed is None else cfg.init_seed)
        self.task = task
        self.k = len(task.verifiers)
        if self.k == 0:
            raise ValueError("task: it has no verifiers (no rewards)")
        self.reward_names = [v.name for v in task.verifiers]
        self.device = resolve_device(cfg.device)
        self.out = Path(cfg.out)
        self.ckpt_dir = self.out / "checkpoint"
        dtype = getattr(torch, cfg.dtype)

        if cfg.model is not None:
            self.init_path = Path(cfg.model)
            model, tok = load_model(cfg.model, dtype=dtype, device=self.device)
        else:
            init_seed = cfg.seed if cfg.init_seed is None else cfg.init_seed
            model, tok = default_model(
                task, seed=init_seed, cache_dir=cfg.cache_dir, cfg=cfg.tiny, log=self.log
            )
            self.init_path = Path(cfg.cache_dir) / f"{task.name}-seed{init_seed}-{cfg.tiny.key()}"
            model = model.to(device=self.device, dtype=dtype)
        self.ref = None
        if cfg.kl_beta > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.model, self.tok = model.eval(), tok
        self.prompter = ChatPrompter(tok)
        self.step = 0
        self.sampler = PromptSampler(len(task.train), cfg.seed)
        seed_everything(cfg.seed)
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99)
        )
        self.metrics: list[dict] = []
        self.samples: list[dict] = []
        if cfg.resume:
            self._resume()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self):
        tmp = self.out / "checkpoint.tmp"
        save_model(self.model, self.tok, tmp / "model")
        torch.save(
            {
                "step": self.step,
                "optimizer": self.opt.state_dict(),
                "rng": rng_state(),
                "sampler": self.sampler.state(),
                "config": self.cfg.to_dict(),
                "samples": self.samples,
            },
            tmp / "state.pt",
        )
        if self.ckpt_dir.exists():
            old = self.out / "checkpoint.old"
            os.replace(self.ckpt_dir, old)
            os.replace(tmp, self.ckpt_dir)
            _rmtree(old)
        else:
            os.replace(tmp, self.ckpt_dir)

    def _resume(self):
        state_path = self.ckpt_dir / "state.pt"
        if not state_path.exists():
            self.log(f"resume: no checkpoint in {self.ckpt_dir}, starting from step 0")
            return
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        model, _ = load_model(
            self.ckpt_dir / "model", dtype=getattr(torch, self.cfg.dtype), device=self.device
        )
        self.model.load_state_dict(model.state_dict())
        self.opt.load_state_dict(state["optimizer"])
        self.sampler.load(state["sampler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.samples = state.get("samples", [])
        path = self.out / "metrics.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.metrics = [r for r in rows if r["step"] <= self.step]
        self.log(f"resumed from {self.ckpt_dir} at step {self.step}")

    # -- one step -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        examples = [self.task.train[i] for i in self.sampler.take(cfg.prompts_per_step)]
        self.model.eval()
        ro = generate_rollouts(self.model, self.prompter, self.task, examples, cfg, self.device)
        t1 = time.perf_counter()
        want_replay = cfg.algo == "mrtpo" or cfg.replay_for_baselines
        rep = contrastive_replay(
            self.model,
            self.prompter,
            [ex.prompt for ex in ro.examples],
            ro.prompt_ids,
            ro.responses,
            ro.spans,
            temperature=cfg.temperature,
            micro_batch=cfg.micro_batch * 2,
            replay=want_replay,
        )
        has_info = torch.tensor([[len(s) > 0 for s in row] for row in ro.spans], dtype=torch.bool)
        lengths = torch.tensor([len(r) for r in ro.responses], dtype=torch.long)
        relevance = rep.relevance
        have_rel = relevance is not None
        if relevance is None:
            relevance = torch.zeros((self.k, int(lengths.sum())), dtype=torch.float32)
        relevance = relevance.float().cpu()
        adv, alloc = compute_advantages(
            cfg.algo, ro.rewards, ro.group_ids, relevance, has_info, lengths, cfg
        )
        ref_logp = None
        if self.ref is not None:
            h_ref = forward_responses(
                self.ref,
                ro.prompt_ids,
                ro.responses,
                self.tok.pad_token_id,
                micro_batch=cfg.micro_batch * 2,
                device=self.device,
            )
            w_ref, b_ref = lm_head(self.ref)
            labels = torch.cat([torch.tensor(r) for r in ro.responses]).to(self.device)
            with torch.no_grad():
                ref_logp = linear_logprobs(
                    h_ref, w_ref, labels, bias=b_ref, temperature=cfg.temperature
                ).cpu()
        t2 = time.perf_counter()
        upd = self._update(ro, rep.old_logprobs.detach().float().cpu(), adv, ref_logp, lengths)
        t3 = time.perf_counter()
        self.step += 1
        row = self._metrics(ro, relevance if have_rel else None, has_info, alloc, lengths, upd)
        row["time"] = {
            "rollout": t1 - t0,
            "replay": t2 - t1,
            "update": t3 - t2,
            "replays": rep.replayed,
        }
        self._keep_samples(ro, relevance, alloc, lengths, have_rel)
        return row

    def _update(self, ro, old_logp, adv, ref_logp, lengths):
        cfg = self.cfg
        n = len(ro.responses)
        starts = torch.zeros(n + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(lengths, 0)
        weight_bias = lambda: lm_head(self.model)
        stats = {"loss": [], "clip_fraction": [], "mean_ratio": [], "kl": [], "grad_norm": []}
        self.model.eval()  # no dropout: the loss must see the rollout policy's distribution
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(n).tolist()
            per_mb = math.ceil(n / cfg.minibatches)
            for s in range(0, n, per_mb):
                mb = perm[s : s + per_mb]
                mb_tokens = int(lengths[mb].sum())
                self.opt.zero_grad(set_to_none=True)
                for m in range(0, len(mb), cfg.micro_batch):
                    rows = mb[m : m + cfg.micro_batch]
                    tb = teacher_batch(
                        [ro.prompt_ids[i] for i in rows],
                        [ro.responses[i] for i in rows],
                        self.tok.pad_token_id,
                        self.device,
                    )
                    idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows])
                    hidden = response_hidden(self.model, tb)
                    w, b = weight_bias()
                    loss, met = linear_policy_loss(
                        hidden,
                        w,
                        tb.labels,
                        old_logp[idx].to(self.device),
                        adv[idx].to(self.device),
                        bias=b,
                        temperature=cfg.temperature,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        ref_logprobs=None if ref_logp is None else ref_logp[idx].to(self.device),
                        beta=cfg.kl_beta,
                    )
                    share = idx.numel() / mb_tokens
                    (loss * share).backward()
                    stats["loss"].append(loss.item() * share)
                    stats["clip_fraction"].append((float(met["clip_fraction"]), idx.numel()))
                    stats["mean_ratio"].append((float(met["mean_ratio"]), idx.numel()))
                    if "kl" in met:
                        stats["kl"].append((float(met["kl"]), idx.numel()))
                gn = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(),
                    cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"),
                )
                stats["grad_norm"].append(float(gn))
                self.opt.step()
        self.opt.zero_grad(set_to_none=True)

        def wmean(pairs):
            tot = sum(c for _, c in pairs)
            return sum(v * c for v, c in pairs) / tot if tot else None

        n_mb = max(1, cfg.ppo_epochs * math.ceil(n / math.ceil(n / cfg.minibatches)))
        return {
            "loss": sum(stats["loss"]) / n_mb,
            "clip_fraction": wmean(stats["clip_fraction"]),
            "mean_ratio": wmean(stats["mean_ratio"]),
            "kl": wmean(stats["kl"]),
            "grad_norm": sum(stats["grad_norm"]) / len(stats["grad_norm"]),
        }

    def _metrics(self, ro, relevance, has_info, alloc, lengths, upd) -> dict:
        r = ro.rewards
        passed = r >= PASS_THRESHOLD
        row = {"step": self.step, "algo": self.cfg.algo, "seed": self.cfg.seed}
        row["all_pass"] = float(passed.all(1).float().mean())
        row["mean_reward"] = float(r.mean())
        row["response_len"] = float(lengths.float().mean())
        starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(lengths, 0)
        seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        masks = relevant_token_masks(self.task, ro)
        prec, unif, counts = credit_precision(alloc, masks, has_info, lengths)
        rel_prec = [None] * self.k
        if relevance is not None:
            rel_prec, _, _ = credit_precision(relevance, masks, has_info, lengths)
        for j, name in enumerate(self.reward_names):
            row[f"pass/{name}"] = float(passed[:, j].float().mean())
            row[f"score/{name}"] = float(r[:, j].mean())
            info = has_info[seg, j]
            has = relevance is not None and bool(info.any())
            row[f"relevance/{name}"] = float(relevance[j][info].mean()) if has else None
            row[f"precision/{name}"] = prec[j]
            row[f"relevance_precision/{name}"] = rel_prec[j]
            row[f"uniform/{name}"] = unif[j]
        pairs = [(p, u, c) for p, u, c in zip(prec, unif, counts) if p is not None]
        rel_pairs = [(p, c) for p, c in zip(rel_prec, counts) if p is not None]
        rel_tot = sum(c for _, c in rel_pairs)
        row["relevance_precision"] = sum(p * c for p, c in rel_pairs) / rel_tot if rel_tot else None
        tot = sum(c for _, _, c in pairs)
        row["credit_precision"] = sum(p * c for p, _, c in pairs) / tot if tot else None
        row["uniform_share"] = sum(u * c for _, u, c in pairs) / tot if tot else None
        row.update(upd)
        return row

    def _keep_samples(self, ro, relevance, alloc, lengths, have_relevance):
        starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(lengths, 0)
        picks = list(range(0, len(ro.responses), self.cfg.group_size))
        picks += [i for i in range(len(ro.responses)) if i not in picks]
        samples = []
        for i in picks[: self.cfg.html_samples]:
            a, b = int(starts[i]), int(starts[i + 1])
            pieces = [ro.texts[i][s:e] for s, e in ro.offsets[i]]
            samples.append(
                {
                    "step": self.step,
                    "prompt": ro.examples[i].prompt,
                    "response": ro.texts[i],
                    "tokens": pieces,
                    "scores": ro.rewards[i].tolist(),
                    "reasons": ro.reasons[i],
                    "spans": [list(map(list, s)) for s in ro.spans[i]],
                    "allocation": alloc[:, a:b].tolist(),
                    "relevance": relevance[:, a:b].tolist() if have_relevance else None,
                }
            )
        self.samples = samples

    # -- the loop -----------------------------------------------------------------------------
    def run(self, *, progress: bool = True) -> TrainResult:
        from tqdm.auto import tqdm

        from .report import plot_curves, write_tokens_html

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        metrics_path = self.out / "metrics.jsonl"
        with open(metrics_path, "w") as f:
            for row in self.metrics:
                f.write(json.dumps(row) + "\n")
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not progress,
            desc=cfg.algo,
            dynamic_ncols=True,
        )
        while self.step < cfg.steps:
            row = self.train_step()
            self.metrics.append(row)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(all_pass=f"{row['all_pass']:.2f}", loss=f"{row['loss']:.3f}")
            if progress:
                bar.write(format_step(row, self.reward_names, cfg.steps))
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.save_checkpoint()
        bar.close()
        curves = plot_curves(
            self.metrics,
            self.reward_names,
            self.out / "curves.png",
            title=f"{self.task.name} / {cfg.algo} / seed {cfg.seed}",
        )
        html = write_tokens_html(
            self.samples,
            self.reward_names,
            self.out / "tokens.html",
            algo=cfg.algo,
            title=f"{self.task.name} / {cfg.algo}",
        )
        return TrainResult(self.out, self.metrics, metrics_path, curves, html, self.ckpt_dir)


def format_step(row: dict, names, total: int) -> str:
    short = lambda s: s if len(s) <= 14 else s[:13] + "."
    parts = [f"step {row['step']:>3}/{total}", f"all {row['all_pass']:.2f}"]
    parts.append(" ".join(f"{short(n)}={row[f'pass/{n}']:.2f}" for n in names))
    rel = [(n, row.get(f"relevance/{n}")) for n in names]
    if any(v is not None for _, v in rel):
        parts.append("rel " + " ".join(f"{v:.3f}" if v is not None else "-" for _, v in rel))
    if row.get("credit_precision") is not None:
        parts.append(f"prec {row['credit_precision']:.2f}/unif {row['uniform_share']:.2f}")
    return " | ".join(parts)


def _rmtree(path: Path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def train(cfg: TrainConfig, *, task=None, progress: bool = True, log=None) -> TrainResult:
    """Run (or resume) a training run; writes metrics.jsonl, curves.png, tokens.html and a
    checkpoint under ``cfg.out``."""
    return Trainer(cfg, task=task, log=log).run(progress=progress)

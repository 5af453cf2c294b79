"""Rollouts: the seeded prompt order, sampling G responses per prompt with ``generate``,
the stop tokens, and scoring every response with every verifier."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from mrtpo.replay.prompting import response_offsets
from mrtpo.verifiers import Verdict

from .config import TrainConfig


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
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
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
    # (n,) True where generation stopped at the token cap, not at a stop token: the answer
    # was cut, so where an end-anchored check (an end phrase) looked is not where it failed
    truncated: list[bool] | None = None


def stop_ids(tokenizer, model) -> set[int]:
    """Token ids that end a response: the tokenizer's and the generation config's EOS."""
    ids = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids


class MaxToZero(LogitsProcessor):
    """Each row's scores minus its max. ``generate`` runs custom processors before its
    temperature warper, whose ``scores / temperature`` overflows to inf (and the softmax to
    NaN) once max |logit| / temperature passes float32's range (logit 10 at temperature
    2^-126); shifted, the row's max divides to 0 and the rest to -inf at worst (probability
    0). The distribution is the same (softmax ignores a shift; top-k and top-p too)."""

    def __call__(self, input_ids, scores):
        return scores - scores.amax(dim=-1, keepdim=True)


@torch.no_grad()
def generate_rollouts(model, prompter, task, examples, cfg: TrainConfig, device) -> Rollouts:
    """``cfg.group_size`` sampled responses per example, cut after the first stop token,
    decoded with character offsets and scored by every verifier."""
    tok = prompter.tokenizer
    enc = [prompter.encode(ex.prompt) for ex in examples]
    width = max(len(e.ids) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e.ids) :] = torch.tensor(e.ids)
        mask[i, width - len(e.ids) :] = 1
    stop = stop_ids(tok, model)
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
        # below 1 only: at 1 and above z / temperature cannot overflow, and the rounding of
        # the recorded runs (all at 1) stays as it was
        logits_processor=LogitsProcessorList([MaxToZero()]) if cfg.temperature < 1.0 else None,
    )
    gen = out[:, width:].tolist()
    n = len(gen)
    rep_examples, prompt_ids, responses, texts, offs = [], [], [], [], []
    rewards, spans, reasons, truncated = [], [], [], []
    for r in range(n):
        ex_i = r // cfg.group_size
        row = gen[r]
        cut = len(row)
        for t, v in enumerate(row):
            if v in stop:
                cut = t + 1
                break
        resp = row[:cut]
        truncated.append(cut == len(row) and not (row and row[-1] in stop))
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
        truncated,
    )


def _failed_verdict(verifier, err):
    return Verdict(0.0, (), f"verifier {getattr(verifier, 'name', '?')} raised: {err!r}")

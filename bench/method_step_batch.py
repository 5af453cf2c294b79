"""The batch of ``python -m bench.method_step`` (bench/method_step.py): the model (the
built-in tiny Qwen2 built in code, or a built-in pretrained model) and one step's
teacher-forced batch, a prompt per group naming K clauses and reward k's span on clause k.
"""

from __future__ import annotations

CLAUSES = (
    "Answer in exactly three sentences.",
    "Mention the word harbor at least twice.",
    "Do not use any commas.",
    "End your answer with the phrase: That is all.",
    "Write the first word in capital letters.",
    "Include a question somewhere in the answer.",
    "Keep every sentence under twenty words.",
    "Name one color.",
)
TOPICS = ("a day at the sea", "a walk in the mountains", "a night train", "an old library")


def prompt_of(p: int, k: int) -> tuple[str, list[list[tuple[int, int]]]]:
    """Prompt ``p``'s text and, per reward, its span (reward k's verdict names clause k)."""
    head = f"Write a short text about {TOPICS[p % len(TOPICS)]}."
    text, spans = head, []
    for c in CLAUSES[:k]:
        text += " "
        spans.append([(len(text), len(text) + len(c))])
        text += c
    return text, spans


def build_model(name: str, max_len: int, cache_dir: str, device: str):
    """(model, tokenizer): the built-in tiny Qwen2 built in code (not warm-started: timing and
    memory do not depend on the weights), or a built-in pretrained model by name."""
    import torch

    from mrtpo.model.loading import build_tiny_model, build_tokenizer, load_model

    if name == "tiny":
        from mrtpo.training.config import TinyConfig

        texts = [prompt_of(p, len(CLAUSES))[0] for p in range(len(TOPICS))] * 4
        tok = build_tokenizer(texts)
        model = build_tiny_model(tok, TinyConfig(max_positions=max(1024, max_len)), seed=0)
        model = model.to(device)
    else:
        model, tok = load_model(name, device=device, cache_dir=cache_dir, dtype=torch.float32)
    model.eval()
    return model, tok


def build_batch(tok, prompter, *, prompts: int, group: int, k: int, length: int, variant: str,
                seed: int) -> dict:  # fmt: skip
    """Prompt texts and ids, responses (random ids, specials excluded), spans, rewards and
    group ids of one step. Rewards differ within each group for every reward (A_k != 0 for
    every pair); under ``mrtpo-half`` the odd rewards are constant within each group (A_k = 0
    exactly: half of the pairs cannot move)."""
    import torch

    special = set(tok.all_special_ids)
    allowed = torch.tensor([t for t in range(len(tok)) if t not in special], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    texts, ids, responses, spans, rewards, groups = [], [], [], [], [], []
    for p in range(prompts):
        text, sp = prompt_of(p, k)
        enc = prompter.encode(text).ids
        for g in range(group):
            texts.append(text)
            ids.append(list(enc))
            pick = torch.randint(len(allowed), (length,), generator=gen)
            responses.append(allowed[pick].tolist())
            spans.append([list(s) for s in sp])
            row = [float((g + j) % 2) for j in range(k)]
            if variant == "mrtpo-half":
                row = [1.0 if j % 2 else v for j, v in enumerate(row)]
            rewards.append(row)
            groups.append(p)
    return dict(texts=texts, prompt_ids=ids, responses=responses, spans=spans,
                rewards=torch.tensor(rewards, dtype=torch.float32),
                group_ids=torch.tensor(groups, dtype=torch.long))  # fmt: skip

"""Models and tokenizers for the trainer: the built-in byte-level tokenizer and tiny causal
LM, access to a model's last hidden states and LM head, and the supervised warm start
(chat templating and span helpers live in ``mrtpo.replay.prompting``).

The built-in default needs no download: a byte-level BPE tokenizer is trained in code on the
task's own text (exact round trip, character offsets, a chat template), and a small Qwen2
causal LM is built from a config and warm-started on the task's gold references so that
reinforcement learning starts with some signal. Any local Hugging Face causal LM works in
its place (``load_model(path)``); the trainer only needs the decoder's last hidden states
(after the final norm) and the LM head weight.

This module builds and loads models; the model access (decoder, hidden states, LM head and
its logit transform, layers) is mrtpo/model/access.py's and the supervised warm start
mrtpo/model/warm_start.py's, their public names importable from here.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mrtpo.replay.prompting import ChatPrompter
from mrtpo.training.config import TinyConfig

from .access import (
    LOGIT_SCALE_FIELDS,
    SOFTCAP_FIELD,
    UNSUPPORTED_LOGIT_FIELDS,
    decoder,
    decoder_layers,
    gradient_checkpointing,
    last_hidden,
    lm_head,
    logit_transform,
)
from .builtin import cache_root
from .folder import build_once, quiet_transformers, save_model
from .warm_start import (
    WARM_MARKER,
    same_training,
    supervised_batch,
    train_digest,
    warm_start,
)

__all__ = [
    "CHAT_TEMPLATE",
    "LOGIT_SCALE_FIELDS",
    "SOFTCAP_FIELD",
    "SPECIAL_TOKENS",
    "UNSUPPORTED_LOGIT_FIELDS",
    "WARM_MARKER",
    "TinyConfig",
    "build_tiny_model",
    "build_tokenizer",
    "count_parameters",
    "decoder",
    "decoder_layers",
    "default_model",
    "gradient_checkpointing",
    "last_hidden",
    "lm_head",
    "load_model",
    "logit_transform",
    "same_training",
    "save_model",
    "supervised_batch",
    "task_texts",
    "train_digest",
    "warm_start",
]

PAD, USER, ASSISTANT, SYSTEM, END = "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [PAD, USER, ASSISTANT, SYSTEM, END]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# --------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(texts: Iterable[str], *, vocab_size: int = 768):
    """A byte-level BPE tokenizer trained on ``texts``, wrapped for transformers.

    Byte-level: every string round-trips exactly and no token is unknown. The tokenizer has
    pad/end/role special tokens and a chat template; ``<|end|>`` is the end of a turn (EOS).
    Deterministic for the same texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size: expected at least {256 + len(SPECIAL_TOKENS)} (bytes + specials), "
            f"got {vocab_size}"
        )
    texts = list(texts)
    if not texts:
        raise ValueError("texts: expected at least one text to train the tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


# --------------------------------------------------------------------------------------------
# The built-in tiny model


def build_tiny_model(tokenizer, cfg: TinyConfig | None = None, *, seed: int = 0):
    """A small Qwen2 causal LM (tied embeddings) sized for ``tokenizer``; seeded init."""
    cfg = TinyConfig() if cfg is None else cfg
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    _plain_sampling(model, tokenizer)
    return model


def _plain_sampling(model, tokenizer):
    gc = model.generation_config
    gc.pad_token_id = tokenizer.pad_token_id
    gc.eos_token_id = tokenizer.eos_token_id
    gc.top_k = None
    gc.top_p = None


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    what: str = "model",
    cache_dir: str | Path | None = None,
    log=None,
):
    """Load a local Hugging Face causal LM and its tokenizer from ``path``, or a built-in
    pretrained model by name (``mrtpo.model.pretrained``: converted once into ``cache_dir``, by
    default the per-user cache folder ``mrtpo.model.builtin.user_cache_dir()``); a
    load failure is a one-line ValueError that starts with ``what`` (the setting that named
    ``path``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .pretrained import builtin_folder, is_builtin, stored_dtype

    quiet_transformers()
    if is_builtin(path):
        path = builtin_folder(str(path), cache_dir, dtype=stored_dtype(dtype), log=log)
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{what}: {str(path)!r} is not a folder with a saved causal LM")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report: what it reports is refused below
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as err:
        why = " ".join(str(err).split())[:300] or type(err).__name__
        raise ValueError(f"{what}: cannot load a causal LM from {str(path)!r} ({why})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # transformers starts missing tensors and tensors of another shape from random values
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(
            f"{what}: the weights in {str(path)!r} lack {len(missing)} of the model's tensors "
            f"({missing[0]}{', ...' if len(missing) > 1 else ''})"
        )
    other = sorted(info.get("mismatched_keys") or (), key=str)
    if other:
        first = other[0]  # (name, shape in the file, shape the config asks for)
        if isinstance(first, tuple) and len(first) == 3:
            first = f"{first[0]} is {list(first[1])}, not {list(first[2])}"
        raise ValueError(
            f"{what}: {len(other)} tensors in {str(path)!r} have another shape than its "
            f"config.json asks for ({first}{', ...' if len(other) > 1 else ''})"
        )
    model = model.to(device)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{what}: the tokenizer in {str(path)!r} has neither a pad nor an eos token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def task_texts(task) -> list[str]:
    """All prompt and reference texts of a task (the tokenizer's training corpus)."""
    texts = []
    for ex in list(task.train) + list(task.eval):
        texts.append(ex.prompt)
        if ex.reference:
            texts.append(ex.reference)
    return texts


def default_model(
    task,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    cfg: TinyConfig | None = None,
    log=None,
):
    """The built-in tiny model for ``task``, warm-started, cached under ``cache_dir`` (default:
    the per-user cache folder, ``user_cache_dir()``) keyed by task, seed and config (later
    runs, e.g. every algorithm of a comparison, reuse it). Built once under a lock and
    published whole, as a built-in model's conversion (``mrtpo.model.folder.build_once``):
    runs that start together on a cold cache warm-start once, and none loads a half-written
    folder; a broken one (a file cut short) or one warm-started on another training set is
    built again."""
    cfg = (TinyConfig() if cfg is None else cfg).for_task(task.name)
    path = cache_root(cache_dir) / f"{task.name}-seed{seed}-{cfg.key()}"

    def build():
        tokenizer = build_tokenizer(task_texts(task), vocab_size=cfg.vocab_size)
        model = build_tiny_model(tokenizer, cfg, seed=seed)
        examples = list(task.train)
        if cfg.warm_noise > 0:
            from mrtpo.tasks.data import noisy_reference

            rng = random.Random(seed + 7919)
            examples = [
                replace(ex, reference=noisy_reference(rng, ex, cfg.warm_noise)) for ex in examples
            ]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            loss = warm_start(
                model,
                ChatPrompter(tokenizer),
                examples,
                steps=cfg.warm_steps,
                batch=cfg.warm_batch,
                lr=cfg.warm_lr,
                seed=seed,
                log=log,
            )
        info = {
            "task": task.name,
            "seed": seed,
            "final_loss": loss,
            "config": asdict(cfg),
            "train_digest": train_digest(task),
        }
        return (lambda tmp: save_model(model, tokenizer, tmp)), info

    build_once(path, WARM_MARKER, build, accept=same_training(task), log=log)
    return load_model(path)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

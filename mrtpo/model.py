"""Models and tokenizers for the trainer: the built-in byte-level tokenizer and tiny causal
LM, access to a model's last hidden states and LM head, and the supervised warm start
(chat templating and span helpers live in ``mrtpo.prompting``).

The built-in default needs no download: a byte-level BPE tokenizer is trained in code on the
task's own text (exact round trip, character offsets, a chat template), and a small Qwen2
causal LM is built from a config and warm-started on the task's gold references so that
reinforcement learning starts with some signal. Any local Hugging Face causal LM works in
its place (``load_model(path)``); the trainer only needs the decoder's last hidden states
(after the final norm) and the LM head weight.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mrtpo_kernels import linear_logprobs

from .builtin_models import cache_root
from .config import TinyConfig
from .model_folder import build_once, quiet_transformers, save_model
from .prompting import ChatPrompter

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
# Model access: the decoder's last hidden states and the LM head


def decoder(model):
    """The decoder stack whose ``last_hidden_state`` (after the final norm) feeds the LM head."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        raise ValueError(
            f"model: {type(model).__name__} has no base model attribute "
            f"{model.base_model_prefix!r}; expected a Hugging Face *ForCausalLM model"
        )
    return base


def lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight (V, d) (the tied embedding where tied) and bias or None."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"model: {type(model).__name__} has no output embeddings (LM head)")
    return head.weight, getattr(head, "bias", None)


# The config fields that transform a Hugging Face model's logits after its LM head, in the
# order its forward applies them (then generation divides by the temperature): Cohere and
# Cohere2 multiply by ``logit_scale``, Granite (and GraniteMoe) divide by
# ``logits_scaling``, Gemma 2 and 3 cap with ``final_logit_softcapping``.
LOGIT_SCALE_FIELDS = ("logit_scale", "logits_scaling")
SOFTCAP_FIELD = "final_logit_softcapping"
# multipliers whose place in the model's forward the fused head does not know: refused
UNSUPPORTED_LOGIT_FIELDS = ("lm_head_multiplier", "output_multiplier")


def logit_transform(model) -> dict:
    """The LM head's logit transform of ``model`` as the fused ops' keywords: ``{"logit_scale":
    s, "softcap": c}`` for ``linear_logprobs``, ``linear_js_distance`` and
    ``linear_policy_loss``, read from its (text) config: ``logit_scale`` (Cohere, Cohere2)
    multiplies, ``logits_scaling`` (Granite) divides (s = 1 / it), ``final_logit_softcapping``
    (Gemma 2, Gemma 3) caps; ``{}`` where the config sets none (the plain head, bit for
    bit). A config that sets ``lm_head_multiplier`` or ``output_multiplier`` is refused
    (ValueError), as is a value the ops would refuse."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in UNSUPPORTED_LOGIT_FIELDS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"model.config.{name}: the fused LM head supports logit_scale, "
                f"logits_scaling and final_logit_softcapping; a model with {name}={value} "
                "is not supported"
            )
    scale = 1.0
    for name in LOGIT_SCALE_FIELDS:
        value = getattr(config, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not (math.isfinite(value) and value != 0):
            raise ValueError(f"model.config.{name}: expected a finite non-zero number, got {value}")
        scale = scale * (float(value) if name == "logit_scale" else 1.0 / float(value))
    cap = getattr(config, SOFTCAP_FIELD, None)
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(
            f"model.config.{SOFTCAP_FIELD}: expected None or a positive finite number, got {cap!r}"
        )
    out = {}
    if scale != 1.0:
        out["logit_scale"] = scale
    if cap is not None:
        out["softcap"] = float(cap)
    return out


def last_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """(B, L, d) last hidden states for left/right-padded input; positions count only the
    tokens the attention mask keeps, so padding does not shift them."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = decoder(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state


# --------------------------------------------------------------------------------------------
# The built-in tiny model


def decoder_layers(model) -> list:
    """The decoder's layers (the blocks a residual stream runs through): the model's
    transformers ``GradientCheckpointingLayer`` modules, else ``decoder(model).layers``."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: the layer list itself
        GradientCheckpointingLayer = ()  # noqa: N806
    found = [
        m
        for m in model.modules()
        if GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer)
    ]
    if found:
        return found
    layers = getattr(decoder(model), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(
            f"model: {type(model).__name__} has no decoder layers to checkpoint "
            "(no GradientCheckpointingLayer modules, no .layers)"
        )
    return list(layers)


@contextlib.contextmanager
def gradient_checkpointing(model, enabled: bool = True):
    """Within: every decoder layer run with gradient keeps only its inputs and recomputes
    its activations in the backward (``torch.utils.checkpoint``, non-reentrant, which
    replays the autocast state). The activations held for the backward of a teacher-forced
    forward fall from every layer's intermediates to one (tokens, d) input per layer (plus
    one layer's intermediates while it is recomputed), for about one more forward of
    compute. Unlike ``model.gradient_checkpointing_enable()`` it does not need train mode
    (the trainer's forwards run in eval mode: no dropout). Forwards without gradient run
    as they are. ``enabled=False``: a no-op."""
    if not enabled:
        yield
        return
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    before = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        run = layer.forward

        def forward(*args, _run=run, **kwargs):
            if not torch.is_grad_enabled():
                return _run(*args, **kwargs)
            return checkpoint(_run, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    try:
        yield
    finally:
        for layer, old in zip(layers, before):
            if old is None:
                del layer.forward
            else:
                layer.forward = old


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
    pretrained model by name (``mrtpo.pretrained``: converted once into ``cache_dir``, by
    default the per-user cache folder ``mrtpo.builtin_models.user_cache_dir()``); a
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


# --------------------------------------------------------------------------------------------
# Supervised warm start


def _reference_of(example) -> str:
    ref = getattr(example, "reference", None)
    if ref is None:
        raise ValueError(f"task: example {example.id!r} has no gold reference to warm-start on")
    return ref


def supervised_batch(prompter: ChatPrompter, examples, *, device="cpu"):
    """Right-padded (prompt + reference + EOS) ids, mask and labels (-100 off the response)."""
    tok = prompter.tokenizer
    rows, labels = [], []
    for ex in examples:
        p = prompter.encode(ex.prompt).ids
        r = tok(_reference_of(ex), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, lr) in enumerate(zip(rows, labels)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        lab[i, : len(row)] = torch.tensor(lr)
    # hidden at position t predicts token t + 1
    return ids.to(device), mask.to(device), lab[:, 1:].to(device)


def warm_start(
    model,
    prompter: ChatPrompter,
    examples,
    *,
    steps,
    batch,
    lr,
    seed=0,
    log=None,
    autocast=None,
    micro_batch=None,
):
    """A short supervised pass (cross-entropy on the gold responses) with AdamW and a
    cosine schedule. ``autocast`` (a dtype, e.g. torch.bfloat16): the decoder's forwards run
    under torch.autocast; the loss, backward and optimizer step stay outside it (whole
    steps inside a CPU bf16 autocast region wrecked a 135M model within a dozen steps
    although its gradients matched float32's). ``micro_batch``: forwards of at most this
    many examples, their gradients accumulated into the same step (the same mean loss over
    the batch's response tokens; less activation memory for long prompts); None: one
    forward per batch. With ``micro_batch``, AdamW also runs one parameter at a time.
    Returns the mean loss of the last 10 steps."""
    if not examples:
        raise ValueError("examples: the task has no training examples")
    if micro_batch is not None and (not isinstance(micro_batch, int) or micro_batch < 1):
        raise ValueError(f"micro_batch: expected an int >= 1 or None, got {micro_batch!r}")
    rng = random.Random(seed)
    # the micro-batched (low-memory) path also updates one parameter at a time: the
    # multi-tensor AdamW holds temporaries the size of all the weights
    foreach = None if micro_batch is None else False
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=foreach)
    weight_fn = lambda: lm_head(model)
    head_kw = logit_transform(model)  # the model's logit scale / softcap, if any
    model.train()
    losses = []
    order: list[int] = []
    device = next(model.parameters()).device
    chunk = batch if micro_batch is None else micro_batch
    for step in range(steps):
        if len(order) < batch:
            perm = list(range(len(examples)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[:batch], order[batch:]
        chosen = [examples[i] for i in idx]
        parts = [
            supervised_batch(prompter, chosen[j : j + chunk], device=device)
            for j in range(0, len(chosen), chunk)
        ]
        n_kept = sum(int((lab != -100).sum()) for _, _, lab in parts)
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / max(steps, 1)))
        opt.zero_grad(set_to_none=True)
        loss_value = 0.0
        for ids, mask, labels in parts:
            amp = contextlib.nullcontext()
            if autocast is not None:
                amp = torch.autocast(ids.device.type, dtype=autocast)
            with amp:
                h = last_hidden(model, ids, mask)[:, :-1]
            w, b = weight_fn()
            keep = labels != -100
            logp = linear_logprobs(h[keep], w, labels[keep], bias=b, **head_kw)
            # one forward: the batch's mean, as before; several: each part's share of it
            loss = -logp.mean() if len(parts) == 1 else -logp.sum() / n_kept
            loss.backward()
            loss_value += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss_value)
        if log is not None and (step % 25 == 0 or step == steps - 1):
            log(f"warm start {step + 1}/{steps}: loss {losses[-1]:.3f}")
    model.eval()
    tail = losses[-10:]
    return sum(tail) / max(len(tail), 1)


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
    published whole, as a built-in model's conversion (``mrtpo.model_folder.build_once``):
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
            from mrtpo.data import noisy_reference

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


# The marker of a warm-started folder (tiny or built-in model): its settings and final loss.
WARM_MARKER = "warm_start.json"
# Tasks whose training set changed since warm starts recorded the digest of theirs: a warm
# start cached before is not trusted for these (the tools split, issue 41), for the others it is.
_RESPLIT = frozenset({"tools"})


def train_digest(task) -> str:
    """A digest of ``task``'s training examples (ids, prompts, references): what a warm
    start was trained on, recorded in its marker."""
    blob = json.dumps([[ex.id, ex.prompt, ex.reference] for ex in task.train]).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def same_training(task):
    """``accept`` for ``build_once``: refuses a warm start recorded as trained on another
    training set than ``task``'s (its data or split changed since)."""
    digest = train_digest(task)

    def accept(info: dict) -> str | None:
        have = info.get("train_digest")
        if have is None and task.name not in _RESPLIT:
            return None  # cached before digests were recorded: trusted
        if have != digest:
            return f"it was warm-started on another training set of {task.name!r}"
        return None

    return accept


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

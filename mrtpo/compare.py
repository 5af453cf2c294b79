"""The import path ``mrtpo.compare`` of the docs before the package's wings (documented:
``run_compare``): the module is now ``mrtpo.training.compare``, whose names this alias hands
out on first use."""


def __getattr__(name: str):
    from importlib import import_module

    return getattr(import_module("mrtpo.training.compare"), name)

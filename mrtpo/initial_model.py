"""The import path ``mrtpo.initial_model`` of the docs before the package's wings (documented:
``initial_folder``): the module is now ``mrtpo.model.initial``, whose names this alias hands
out on first use."""


def __getattr__(name: str):
    from importlib import import_module

    return getattr(import_module("mrtpo.model.initial"), name)

"""The import path ``mrtpo.trainer`` of the docs before the package's wings (documented:
``train``): the module is now ``mrtpo.training.trainer``, whose names this alias hands out on
first use."""


def __getattr__(name: str):
    from importlib import import_module

    return getattr(import_module("mrtpo.training.trainer"), name)

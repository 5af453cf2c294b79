"""The import path ``mrtpo.config`` of the docs before the package's wings (documented:
``TrainConfig``, ``CompareConfig``, ``TinyConfig``): the module is now
``mrtpo.training.config``, whose names this alias hands out on first use."""


def __getattr__(name: str):
    from importlib import import_module

    return getattr(import_module("mrtpo.training.config"), name)

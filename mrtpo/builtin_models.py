"""The import path ``mrtpo.builtin_models`` of the docs before the package's wings (documented:
``user_cache_dir``, ``is_builtin``): the module is now ``mrtpo.model.builtin``, whose names
this alias hands out on first use."""


def __getattr__(name: str):
    from importlib import import_module

    return getattr(import_module("mrtpo.model.builtin"), name)

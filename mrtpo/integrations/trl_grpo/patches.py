"""What ``MRTPOGRPOTrainer`` changes in TRL while it builds: TRL's model loader, patched
for the duration of ``GRPOTrainer.__init__`` so that a policy TRL cannot load by name gets
a frozen copy of itself as reference model (``_reference_from_policy``), and the warnings
of TRL's use of transformers' deprecated checkpointing aliases, filtered.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings

import torch
from huggingface_hub.utils import validate_repo_id
from trl import GRPOTrainer

# TRL 1.16 reads and toggles checkpointing around each generation through transformers'
# deprecated model aliases (``is_gradient_checkpointing``, ``gradient_checkpointing_disable``,
# ``gradient_checkpointing_enable``): under transformers >= 5 each prints a FutureWarning per
# process that no user line causes. Exactly those three, raised in transformers.modeling_utils,
# are ignored once a trainer exists; any other warning, and the config alias's, still shows.
_TRL_CHECKPOINTING_ALIASES = (
    r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)`"
    r" is deprecated"
)


def _ignore_trl_checkpointing_aliases() -> None:
    warnings.filterwarnings(
        "ignore",
        message=_TRL_CHECKPOINTING_ALIASES,
        category=FutureWarning,
        module=r"transformers\.modeling_utils",
    )


def _model_id(model) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def _hub_loadable(name: str) -> bool:
    """Whether TRL can load a model called ``name``: a local folder or a valid hub id."""
    if not name:
        return False
    if os.path.isdir(name):
        return True
    try:
        validate_repo_id(name)
    except Exception:  # noqa: BLE001 - any refusal means TRL cannot load it either
        return False
    return not os.path.isabs(name) and not name.startswith((".", "~"))


@contextlib.contextmanager
def _reference_from_policy(model):
    """While GRPOTrainer builds its reference model (beta > 0), a policy passed as a model
    whose name TRL cannot load (a model built in code, or saved nowhere TRL can find)
    gets as reference a frozen copy of itself: the policy's weights at construction, its
    config, dtype and attention implementation. TRL loads any other name itself."""
    module = sys.modules[GRPOTrainer.__module__]
    original = module.create_model_from_path
    if isinstance(model, str) or model is None or _hub_loadable(_model_id(model)):
        yield
        return

    def create(name, **kwargs):
        if name != _model_id(model):
            return original(name, **kwargs)
        ref = copy.deepcopy(model)
        dtype = kwargs.get("dtype")
        if isinstance(dtype, torch.dtype):
            ref = ref.to(dtype)
        ref.requires_grad_(False)
        return ref.eval()

    module.create_model_from_path = create
    try:
        yield
    finally:
        module.create_model_from_path = original

"""Helpers shared by the ops' torch.library registrations (each op registers its custom op,
fake and autograd beside its public function: logprobs.py, js.py, policy_loss.py,
advantages.py): row-sized empties for the fakes, and the bookkeeping of the log-probs
forwards' ``saved`` output (what the backward needs from the forward; logprobs.py).

Registering the ops lets torch.compile(fullgraph=True) trace a caller without graph breaks
and lets torch.library.opcheck test them. The backend is a plain string argument that the
public functions resolve before the call, so no op looks at data to decide anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._types import acc_dtype


def empty_rows(like: Tensor, n: int) -> Tensor:
    """An empty (n,) tensor in the accumulation dtype of ``like`` on its device."""
    return like.new_empty(n, dtype=acc_dtype(like))


def keep_saved(ctx, saved: Tensor) -> None:
    """Keep the forward's ``saved`` (eager: a plain tensor, not traced) and its version."""
    eager = type(saved) is torch.Tensor and not torch.compiler.is_compiling()
    ctx.saved = saved.detach() if eager else None
    ctx.saved_version = saved._version if eager else None


def saved_state(ctx) -> Tensor | None:
    """The forward's ``saved`` for this backward, or None (traced, or overwritten by an
    earlier backward of the same graph)."""
    s = ctx.saved
    return s if s is not None and s._version == ctx.saved_version else None

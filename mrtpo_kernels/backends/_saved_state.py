"""What the chunk driver's log-probs forward keeps for its backward (backends/_chunked_logprobs.py).

What the log-probs backward needs from its forward travels as the forward's fourth
output, ``saved`` (the op saves it for the backward, mrtpo_kernels/logprobs.py), a flat fp32
tensor whose size says what it holds (saved_numel: the same rule for the op's fake):
  fast mode      the fp32 logits of the call's last kept_rows(n, V) rows, (k, V)
                 row-major: the backward takes them first and needs no recompute there
                 (in place mode overwrites them with the gradient: the op declares the
                 mutation, so a second backward of the same graph sees a new version and
                 passes no state, recomputing every row)
  low-memory     each row's raw max M and log s, (2, n), for the column kernel (kernels
                 that take ``norm=``), so log p never comes from the rounded lse
  otherwise      empty: the backward recomputes every row
"""

from __future__ import annotations

import torch

from .. import settings


def kept_rows(n: int, v: int) -> int:
    """Rows of fp32 logits the log-probs forward keeps for its backward (the last ones)."""
    return min(n, settings.keep_logits_bytes() // (4 * max(v, 1)))


def saved_numel(kern, op: str, n: int, v: int, weight_numel: int) -> int:
    """Elements of the log-probs forward's ``saved`` output for public op ``op`` (only
    linear_logprobs saves anything), this kernel and shape (``contract.Backend``)."""
    if op != "linear_logprobs":
        return 0
    if low_memory_for(kern, weight_numel):
        return 2 * n if takes_norm(kern) else 0
    return kept_rows(n, v) * v


def kept_from(saved, n: int, v: int):
    """(kept logits (k, V) or None, k) from a fast-mode ``saved``; none for an empty or a
    foreign one (a size that is not whole rows of at most n)."""
    if saved is None or saved.numel() == 0 or v == 0 or saved.numel() % v:
        return None, 0
    k = saved.numel() // v
    return (saved.view(k, v), k) if k <= n else (None, 0)


def takes_norm(kern) -> bool:
    """Whether the kernel's stats and grad_cols_ take ``norm=`` (``RowKernel.NORM``)."""
    return kern.NORM


def norm_buffer(kern, n, like) -> torch.Tensor | None:
    """A (2, n) fp32 buffer for stats(..., norm=) where the kernel takes one, else None."""
    return like.new_empty((2, n), dtype=torch.float32) if takes_norm(kern) else None


def norm_rows(norm, a, b) -> dict:
    """stats' keyword for rows [a, b): the column slice of the (2, N) buffer, or none."""
    return {} if norm is None else {"norm": norm[:, a:b]}


def low_memory_for(kern, weight_numel: int) -> bool:
    """Whether a call takes the low-memory mode: the kernel has the column kernels
    (GRAD_COLS) and settings.low_memory says so for an fp32 dW of this size."""
    return kern.GRAD_COLS and settings.low_memory(4 * weight_numel)

"""Input checks shared by the public ops. Every failure is a ValueError naming the argument.

Checks of values (labels in range, finite rewards) read data and so synchronize with the
device; they are skipped while torch.compile traces (shapes, dtypes and devices are still
checked) and can be turned off with ``MRTPO_SKIP_VALUE_CHECKS=1``.
"""

from __future__ import annotations

import math

import torch

from . import settings

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def value_checks_enabled() -> bool:
    return settings.value_checks() and not torch.compiler.is_compiling()


def check_tensor(
    name: str, t, *, ndim=None, min_ndim=None, dtypes=None, floating: bool | None = None
) -> torch.Tensor:
    """ValueError naming ``name`` unless ``t`` is a tensor of the given rank and kind.

    ndim: an int or a tuple of allowed ranks; min_ndim: the least rank; dtypes: allowed
    dtypes; floating: True asks for a floating-point dtype. Returns ``t``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(f"{a}-D" for a in allowed)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(
            f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(t.shape)}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({names}), got {t.dtype}")
    if floating and not t.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    return t


def float_tensor(name: str, t, **kw) -> torch.Tensor:
    return check_tensor(name, t, dtypes=FLOAT_DTYPES, **kw)


def int_tensor(name: str, t, **kw) -> torch.Tensor:
    check_tensor(name, t, **kw)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor, got {t.dtype}")
    return t


def same_device(**named: torch.Tensor | None) -> torch.device:
    items = [(k, v) for k, v in named.items() if v is not None]
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.device != first.device:
            raise ValueError(
                f"{k}: expected a tensor on {first.device} (like {first_name}), got {v.device}"
            )
    return first.device


def same_dtype(**named: torch.Tensor | None) -> None:
    items = [(k, v) for k, v in named.items() if v is not None]
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.dtype != first.dtype:
            raise ValueError(
                f"{k}: expected dtype {first.dtype} (like {first_name}), got {v.dtype}"
            )


def shape_eq(name: str, t: torch.Tensor, shape, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def positive_finite(name: str, x: float) -> float:
    x = float(x)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"{name}: expected a positive finite number, got {x}")
    return x


def non_negative(name: str, x: float) -> float:
    x = float(x)
    if not (x >= 0 and math.isfinite(x)):
        raise ValueError(f"{name}: expected a finite number >= 0, got {x}")
    return x


def choice(name: str, x, options) -> None:
    if x not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}; got {x!r}")


def non_empty(name: str, n: int, what: str = "tokens") -> None:
    if n == 0:
        raise ValueError(f"{name}: empty batch (0 {what})")


def labels_in_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    if not value_checks_enabled() or labels.numel() == 0:
        return
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise ValueError(
            f"labels: expected values in [0, {vocab}) or ignore_index={ignore_index}, found {first}"
        )


def flatten_tokens(hidden: torch.Tensor, labels: torch.Tensor, hname: str = "hidden"):
    """Check hidden (..., d) and labels (...); return them as (N, d) and (N,) int64."""
    float_tensor(hname, hidden, min_ndim=2)
    int_tensor("labels", labels)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(hidden.shape[:-1])} (the leading dimensions of "
            f"{hname}), got {tuple(labels.shape)}"
        )
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()


def lm_head(hidden: torch.Tensor, weight, bias) -> None:
    """Check an LM head weight (V, d) and optional bias (V,) against hidden (..., d)."""
    float_tensor("weight", weight, ndim=2)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected shape (V, {hidden.shape[-1]}) (d from hidden), "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary is empty (V = 0)")
    if bias is not None:
        float_tensor("bias", bias, ndim=1)
        shape_eq("bias", bias, (weight.shape[0],), "V from weight")
    same_dtype(hidden=hidden, weight=weight, bias=bias)

"""Input checks shared by the public ops. Every failure is a ValueError naming the argument.

Checks of values (labels in range, finite rewards) read data and so synchronize with the
device; they are skipped while torch.compile traces (shapes, dtypes and devices are still
checked) and can be turned off with ``MRTPO_SKIP_VALUE_CHECKS=1``.
"""

from __future__ import annotations

import math
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def value_checks_enabled() -> bool:
    if os.environ.get("MRTPO_SKIP_VALUE_CHECKS", "0") not in ("", "0"):
        return False
    try:
        return not torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - very old torch
        return True


def tensor(name: str, t, *, ndim=None, dtypes=None, min_ndim=None) -> torch.Tensor:
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
    return t


def float_tensor(name: str, t, **kw) -> torch.Tensor:
    return tensor(name, t, dtypes=FLOAT_DTYPES, **kw)


def int_tensor(name: str, t, **kw) -> torch.Tensor:
    tensor(name, t, **kw)
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

"""Input checks shared by the public ops. Every failure is a ValueError naming the argument.

Checks of values (labels in range, finite rewards) read data and so synchronize with the
device; they are skipped while torch.compile traces (shapes, dtypes and devices are still
checked) and can be turned off with ``MRTPO_SKIP_VALUE_CHECKS=1``.
"""

from __future__ import annotations

import math
import operator

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


def finite(x: float) -> bool:
    """math.isfinite by comparisons, which torch.compile also traces for a symbolic float
    (a temperature that changes between calls, or dynamic=True): NaN fails both."""
    return -math.inf < x < math.inf


def number(name: str, x) -> float:
    """float(x), or a ValueError naming ``name`` when x is not a real number (a string,
    None, a bool, a complex number, a tensor of more than one element)."""
    if isinstance(x, (str, bytes, bool)) or x is None:
        raise ValueError(f"{name}: expected a number, got {type(x).__name__} {x!r}")
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name}: expected a number, got {type(x).__name__}") from None


def integer(name: str, x) -> int:
    """x as an int (Python or NumPy integers, not bool, not a float), else ValueError."""
    if isinstance(x, bool):
        raise ValueError(f"{name}: expected an integer, got bool {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{name}: expected an integer, got {type(x).__name__} {x!r}") from None


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def int64(name: str, x) -> int:
    """``integer(name, x)`` that also fits an int64 (what the kernels and the label tensors
    hold), else a ValueError naming ``name``."""
    x = integer(name, x)
    if not INT64_MIN <= x <= INT64_MAX:
        raise ValueError(f"{name}: expected an integer in [-2^63, 2^63 - 1] (int64), got {x}")
    return x


# The temperatures the kernels take: [2^-126, 2^126], so that 1 / temperature and the
# kernels' 2 / temperature are finite, normal float32 numbers. Below about 5.9e-39,
# 2 / temperature is inf and a row's max entry scales to 0 * inf = NaN; above about 1.4e45 it
# is 0 and a -inf (masked) entry scales to -inf * 0 = NaN.
MIN_TEMPERATURE = 2.0**-126
MAX_TEMPERATURE = 2.0**126


def temperature(x) -> float:
    """A sampling temperature: a number in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [2^-126,
    2^126], else a ValueError naming ``temperature``."""
    t = positive_finite("temperature", x)
    if not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise ValueError(
            f"temperature: expected a number in [2^-126, 2^126] = [{MIN_TEMPERATURE:.9g}, "
            f"{MAX_TEMPERATURE:.9g}] (1 / temperature must be a finite normal float32), "
            f"got {t:.9g}"
        )
    return t


def logit_cap(logit_scale, softcap) -> tuple[float, float]:
    """The LM head's logit transform (``_types.LogitCap``): logit_scale a finite non-zero
    number, softcap None or a positive finite number, both of magnitude in [2^-126, 2^126]
    (so that they and 1 / softcap are normal float32 numbers). Returns (scale, softcap)
    with softcap 0.0 for none."""
    scale = number("logit_scale", logit_scale)
    if not (finite(scale) and MIN_TEMPERATURE <= abs(scale) <= MAX_TEMPERATURE):
        raise ValueError(
            "logit_scale: expected a finite non-zero number of magnitude in [2^-126, 2^126] "
            f"(1.0: no scaling), got {scale}"
        )
    if softcap is None:
        return scale, 0.0
    cap = number("softcap", softcap)
    if not (cap > 0 and finite(cap) and MIN_TEMPERATURE <= cap <= MAX_TEMPERATURE):
        raise ValueError(
            "softcap: expected None (no softcapping) or a positive finite number in "
            f"[2^-126, 2^126], got {cap}"
        )
    return scale, cap


def positive_finite(name: str, x) -> float:
    x = number(name, x)
    if not (x > 0 and finite(x)):
        raise ValueError(f"{name}: expected a positive finite number, got {x}")
    return x


def non_negative(name: str, x) -> float:
    x = number(name, x)
    if not (x >= 0 and finite(x)):
        raise ValueError(f"{name}: expected a finite number >= 0, got {x}")
    return x


def unit_interval(name: str, x) -> float:
    x = number(name, x)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {x}")
    return x


def pair(name: str, x) -> tuple[float, float]:
    """A (low, high) pair of numbers given as a tuple or list of length 2."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise ValueError(f"{name}: expected a pair (low, high), got {x!r}")
    return number(name, x[0]), number(name, x[1])


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
    last_dim_positive(hname, hidden)
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


def last_dim_positive(name: str, t: torch.Tensor) -> None:
    """ValueError unless the last dimension (d of hidden states, V of logits) is non-empty;
    checked before any reshape, which cannot infer the other dimensions of a 0-wide tensor."""
    if t.shape[-1] == 0:
        what = "vocabulary (V" if name.startswith("logits") else "hidden size (d"
        raise ValueError(f"{name}: the {what} = 0) is empty, got shape {tuple(t.shape)}")


def all_finite(name: str, t: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Value check: every entry of t (or every entry where ``where`` is True) is finite."""
    if not value_checks_enabled() or t.numel() == 0:
        return
    bad = ~torch.isfinite(t)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}: non-finite value {t[idx].item()} at index {idx}")


def zero_one(name: str, t: torch.Tensor) -> torch.Tensor:
    """A mask: a bool tensor, or an integer/float tensor holding only 0 and 1 (value check).
    Returns it as bool."""
    check_tensor(name, t)
    if t.dtype == torch.bool:
        return t
    if t.dtype.is_complex:
        raise ValueError(f"{name}: expected a bool or 0/1 tensor, got {t.dtype}")
    if value_checks_enabled() and t.numel() and bool(((t != 0) & (t != 1)).any()):
        bad = t[(t != 0) & (t != 1)][0].item()
        raise ValueError(f"{name}: expected a bool or 0/1 tensor, found {bad}")
    return t != 0


def boundaries(name: str, cu, n_tokens: int, n_seqs: int | None = None) -> torch.Tensor:
    """Sequence boundaries cu (n+1,) integer: 0 = cu[0] <= cu[1] <= ... <= cu[n] = n_tokens.
    Returns cu as int64.

    The order and the ends are value checks. They also run with the checks off on CPU
    tensors outside a torch.compile trace (no device sync to save there). Elsewhere (a GPU
    tensor with the checks off, or while torch.compile traces) the boundaries are not read
    but made safe without a sync: clamped into [0, n_tokens], made non-decreasing (running
    maximum), first 0 and last n_tokens. The segment kernels (repeat_interleave with an
    output size, the CUDA/Triton segment loops) trust the boundaries: a negative step or
    one past N would make them write outside their buffers. Bad boundaries then give a
    wrong result, never a memory error."""
    int_tensor(name, cu, ndim=1)
    if n_seqs is not None:
        shape_eq(name, cu, (n_seqs + 1,), "n + 1 boundaries")
    elif cu.shape[0] < 2:
        raise ValueError(f"{name}: expected at least 2 boundaries (0 and N), got {cu.shape[0]}")
    cu = cu.long()
    eager_cpu = cu.device.type == "cpu" and not torch.compiler.is_compiling()
    if not (value_checks_enabled() or eager_cpu):
        if cu.shape[0] == 1:
            return cu.new_full((1,), n_tokens)
        inner = torch.cummax(cu[1:-1].clamp(0, n_tokens), 0).values
        return torch.cat([cu.new_zeros(1), inner, cu.new_full((1,), n_tokens)])
    steps = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != n_tokens or bool((steps < 0).any()):
        shown = cu.tolist()
        shown = shown if len(shown) <= 8 else shown[:8] + ["..."]
        raise ValueError(
            f"{name}: expected non-decreasing boundaries from 0 to N = {n_tokens}, got {shown}"
        )
    return cu


def counts(name: str, t, n: int) -> None:
    """Per-response token counts (n,): positive whole numbers (an integer or float tensor)."""
    check_tensor(name, t, ndim=1)
    shape_eq(name, t, (n,), "one length per response")
    if t.dtype == torch.bool or t.dtype.is_complex:
        raise ValueError(f"{name}: expected integer or float token counts, got {t.dtype}")
    if value_checks_enabled() and t.numel():
        if t.dtype.is_floating_point:
            bad = ~(torch.isfinite(t) & (t >= 1) & (t == t.floor()))
        else:
            bad = t < 1
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"{name}: expected positive whole token counts, got {t[i].item()} at {i}"
            )

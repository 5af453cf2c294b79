"""Every MRTPO_* environment variable the package reads, with its default and meaning.

This module imports nothing from the package (any layer may import it) and reads the
environment at each call, so a test or a benchmark can change a variable between calls.
A variable that is set but cannot be read (a number that is not one) raises ValueError
naming the variable. An empty value counts as unset.

The build knobs (``MRTPO_SKIP_CUDA_BUILD``, ``MRTPO_FORCE_CUDA``, ``MRTPO_CUDA_ARCHS``) are
read by setup.py at build time and listed here so that this is the one list of them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_GRAD_BUFFER_BYTES = 608 << 20
DEFAULT_JS_SCRATCH_BYTES = 768 << 20
DEFAULT_KEEP_LOGITS_BYTES = 64 << 20
DEFAULT_DW_BUDGET_BYTES = 8 << 30
LOW_MEMORY_MODES = ("auto", "0", "1")

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "MRTPO_BACKEND",
            "auto",
            "backend for every op when the call passes no backend=: auto, cpu, torch, "
            "triton or cuda",
        ),
        Setting(
            "MRTPO_STRICT_BACKEND",
            "0",
            "1: a requested backend that cannot run an op raises instead of warning once and "
            "running on the next one (the benchmarks set it)",
        ),
        Setting(
            "MRTPO_SKIP_VALUE_CHECKS",
            "0",
            "1: skip the input checks that read data (labels in range, finite rewards, "
            "boundaries), which synchronize with the device; the kernels stay memory-safe "
            "(CPU: out-of-range labels and bad cu_seqlens still raise)",
        ),
        Setting(
            "MRTPO_CHUNK_BYTES",
            str(DEFAULT_CHUNK_BYTES),
            "bytes of one fp32 logits chunk of the chunk driver (the rows of one row-kernel "
            "call; where the gradient is written in place, also the gradient buffer) and, in "
            "the low-memory backward, of the vocabulary chunk of all N rows; smaller saves "
            "memory, larger saves launches",
        ),
        Setting(
            "MRTPO_GRAD_BUFFER_BYTES",
            str(DEFAULT_GRAD_BUFFER_BYTES),
            "bytes of the chunk driver's 16-bit gradient buffer (Triton row kernels, 16-bit "
            "inputs, 16-bit GEMMs with fp32 output): the logit gradients of several logits "
            "chunks, so that dh and dW run once per buffer with K = its rows (about 2000 at "
            "V = 151936); docs/kernels.md has the cost model's table behind the default",
        ),
        Setting(
            "MRTPO_JS_SCRATCH_BYTES",
            str(DEFAULT_JS_SCRATCH_BYTES),
            "bytes of the JS one-vs-K fp32 logits scratch (P and the K streams of one token "
            "chunk, stacked for one GEMM; the cpu and triton row kernels)",
        ),
        Setting(
            "MRTPO_ROW_BLOCK",
            "",
            "COLUMNS,WARPS: the Triton row kernels' columns per step (a power of two, at "
            "least 16) and warps per row program instead of the built-in 2048,8 (for tuning "
            "on a GPU; bench.gpu_micro --part rows-sweep times a grid of them)",
        ),
        Setting(
            "MRTPO_OVERLAP_ROWS",
            "0",
            "1: on a CUDA device, the chunk driver's backward, policy loss and log-probs "
            "forward (16-bit GEMM path) run each chunk's row kernel on a side stream while "
            "the next chunk's logits GEMM runs (one fp32 logits chunk more of memory: "
            "268 MB at V = 151936, which takes the defaults past 1 GB); an experiment, off "
            "by default, not yet run on a GPU: kept only if bench/gpu_window.sh measures "
            "it >= 2% faster on both the policy loss and log-probs, else removed",
        ),
        Setting(
            "MRTPO_LOW_MEMORY",
            "auto",
            "1: the chunk driver's backward recomputes the logits per vocabulary chunk and "
            "writes each dW row block once in the weight's dtype (no fp32 dW accumulator); "
            "0: never; auto: when the fp32 dW accumulator would pass MRTPO_DW_BUDGET_BYTES "
            "(Triton row kernels only)",
        ),
        Setting(
            "MRTPO_DW_BUDGET_BYTES",
            str(DEFAULT_DW_BUDGET_BYTES),
            "the largest fp32 weight-gradient accumulator (4 V d bytes) MRTPO_LOW_MEMORY=auto "
            "allows before it switches to the low-memory backward",
        ),
        Setting(
            "MRTPO_KEEP_LOGITS_BYTES",
            str(DEFAULT_KEEP_LOGITS_BYTES),
            "bytes of fp32 logits the chunked log-probs forward keeps for its backward (the "
            "last rows of the call, returned in the op's saved output; those rows then cost "
            "3 GEMMs instead of 4, the rest are recomputed); the backward reads them and "
            "adds its own chunk, so the extra memory is this plus the chunk driver's "
            "buffers; 0: recompute every row",
        ),
        Setting(
            "MRTPO_CPU_BF16_GEMM",
            "1",
            "1: on a CPU whose oneDNN has bf16 GEMMs (AVX512-BF16 or AMX), the chunk "
            "driver's logits GEMM runs on bf16 operands with fp32 accumulation and output "
            "when the hidden states and the LM head are both bf16 (their values are bf16, so "
            "the operands lose nothing); 0: the fp32 GEMM on upcast copies",
        ),
        Setting("MRTPO_SKIP_CUDA_BUILD", "0", "build time: 1 never builds the CUDA extension"),
        Setting("MRTPO_SKIP_CPU_BUILD", "0", "build time: 1 does not build the CPU extension"),
        Setting(
            "MRTPO_FORCE_CUDA",
            "0",
            "build time: 1 builds the CUDA extension even if torch sees no GPU",
        ),
        Setting(
            "MRTPO_CUDA_ARCHS",
            "90",
            "build time: semicolon-separated compute capabilities of the CUDA extension",
        ),
    )
}


def raw(name: str) -> str:
    """The variable's value, or its default when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value if value else SETTINGS[name].default


def flag(name: str) -> bool:
    value = raw(name).lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(f"{name}: expected 0 or 1 (or true/false), got {value!r}") from None


def positive_int(name: str) -> int:
    value = raw(name)
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return number


# --------------------------------------------------------------------------- the settings


def backend() -> str:
    return raw("MRTPO_BACKEND")


def strict_backend() -> bool:
    return flag("MRTPO_STRICT_BACKEND")


def value_checks() -> bool:
    return not flag("MRTPO_SKIP_VALUE_CHECKS")


def chunk_bytes() -> int:
    return positive_int("MRTPO_CHUNK_BYTES")


def grad_buffer_bytes() -> int:
    return positive_int("MRTPO_GRAD_BUFFER_BYTES")


def cpu_bf16_gemm() -> bool:
    return flag("MRTPO_CPU_BF16_GEMM")


def js_scratch_bytes() -> int:
    return positive_int("MRTPO_JS_SCRATCH_BYTES")


def _int_list(name: str) -> tuple[int, ...] | None:
    """A comma-separated list of integers, () where one is not an integer, None if unset."""
    value = raw(name)
    if not value:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        return ()


def row_block() -> tuple[int, int] | None:
    """The MRTPO_ROW_BLOCK override as (columns per step, warps), or None."""
    parts = _int_list("MRTPO_ROW_BLOCK")
    if parts is None:
        return None
    cols_ok = len(parts) == 2 and parts[0] >= 16 and parts[0] & (parts[0] - 1) == 0
    if not (cols_ok and parts[1] in (1, 2, 4, 8, 16, 32)):
        raise ValueError(
            "MRTPO_ROW_BLOCK: expected COLUMNS,WARPS (columns a power of two >= 16, warps "
            f"1, 2, 4, 8, 16 or 32), got {raw('MRTPO_ROW_BLOCK')!r}"
        )
    return parts  # type: ignore[return-value]


def keep_logits_bytes() -> int:
    value = raw("MRTPO_KEEP_LOGITS_BYTES")
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"MRTPO_KEEP_LOGITS_BYTES: expected a non-negative integer, got {value!r}")
    return number


def overlap_rows() -> bool:
    return flag("MRTPO_OVERLAP_ROWS")


def dw_budget_bytes() -> int:
    return positive_int("MRTPO_DW_BUDGET_BYTES")


def low_memory(dw_accumulator_bytes: int) -> bool:
    """Whether the backward runs in low-memory mode for an fp32 dW of this many bytes."""
    value = raw("MRTPO_LOW_MEMORY").lower()
    if value == "auto":
        return dw_accumulator_bytes > dw_budget_bytes()
    try:
        return flag("MRTPO_LOW_MEMORY")
    except ValueError:
        raise ValueError(f"MRTPO_LOW_MEMORY: expected auto, 0 or 1, got {value!r}") from None

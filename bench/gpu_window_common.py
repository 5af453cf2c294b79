"""What every part of the GPU window (bench/gpu_window.py) shares: the rules, fixed before
the window runs, and the ``decision`` record that quotes them; the MRTPO_* arms the parts
compare; the timers (CUDA events on a GPU, the wall clock in the dry run) and the peak
memory of one call; the three ops at the window's shape.
"""

from __future__ import annotations

import os
import statistics
import time

from .gpu_micro import op_calls

# The rules, fixed before the window runs (bench/gpu_window.sh's header quotes each line;
# tests/test_bench.py checks that it does).
THRESHOLDS = {
    "state": "clocks: an SM clock under 90% of its max, or any active throttle reason other "
    "than idle, before or after, marks every timing of the window as throttled",
    "timeline": "idle gaps: more than 3 ms of idle time between kernels in one call of an op "
    "-> fold the small kernels into the row kernel where they take more than 1 ms, else "
    "capture the chunk loop in a CUDA graph; 3 ms or less -> neither",
    "ab_overlap": "overlap: kept only if MRTPO_OVERLAP_ROWS=1 is at least 2% faster than the "
    "default on both the policy loss and log-probs (medians, same process); else removed",
    "ab_low_memory": "low-memory backward: made the default (MRTPO_LOW_MEMORY=1) if it is "
    "within 3% of the default's time on both ops (it drops the 2.4 GB fp32 dW accumulator)",
    "cublas_rows": "chunk rows: round the logits chunk to a multiple of 128 rows if the best "
    "128-aligned row count gets at least 3% more TFLOP/s than the plan's 410 rows",
    "cublas_k": "gradient buffer: 4096 rows if dW at K = 4096 gets at least 5% more TFLOP/s "
    "than at K = 2048 (and the memory target still holds), else 2048",
    "rows": "row kernels: a kernel under 2.5 TB/s back to back at in-op size is the next "
    "kernel to rewrite; the split-row statistics kernel replaces the one-program-per-row one "
    "if it is at least 1.2x faster",
    "peers": "peers: ours must be faster than Liger (accum_dtype=float32) and Cut "
    "Cross-Entropy (cce_exact) on log-probs fwd+bwd at no more extra memory than theirs; "
    "a miss is recorded as a miss",
}


def _decide(emit, key: str, measured, outcome: str) -> None:
    emit({"part": "decision", "name": key, "rule": THRESHOLDS[key], "measured": measured,
          "outcome": outcome})  # fmt: skip


class _Env:
    """Set MRTPO_* variables for a block (the driver reads them at each call)."""

    def __init__(self, **kv):
        self.kv = {k: str(v) for k, v in kv.items()}

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.kv}
        os.environ.update(self.kv)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


CONFIGS = {  # the A/B arms (and the timeline's two): MRTPO_* variables each
    "default": {},
    "overlap": {"MRTPO_OVERLAP_ROWS": "1"},
    "low_memory": {"MRTPO_LOW_MEMORY": "1"},
}


def _sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _elapsed_ms(torch, fn, calls: int = 1) -> float:
    """One timing of ``calls`` back-to-back calls: CUDA events on a GPU, else wall clock."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _median_ms(torch, fn, repeats=3, calls=1) -> float:
    fn()
    _sync(torch)
    return statistics.median(_elapsed_ms(torch, fn, calls) / calls for _ in range(repeats))


def _extra_mb(torch, fn) -> float:
    """Peak device memory of one call beyond what was allocated before it (0 on the CPU)."""
    if not torch.cuda.is_available():
        fn()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def _ops(torch, args):
    """{name: (call, flops)}: the three ops at the window's shape, one call each."""
    from . import formulas

    n, d, v = args.n, args.d, args.v
    calls = op_calls(torch, args)
    return {name: (fn, formulas.flops(name, n, d, v, k)) for name, fn, k in calls}

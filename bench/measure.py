"""Timing and memory of one cell.

Time: wall clock per call (CPU), CUDA events around each call after a synchronize (GPU);
the median with the 20th and 80th percentiles over the repeats, after warm-up. On the CPU
also the median process CPU time per call (all threads; cpu_ms_p50): on a machine shared
with other jobs the wall time stretches with the load, the CPU time much less.

Memory, measured over the timed calls only:
    CPU: process peak RSS. The kernel's high-water mark (VmHWM) is reset to the current RSS
         after warm-up (writing 5 to /proc/self/clear_refs), so the peak is that of the
         timed calls; where the reset is not allowed, ru_maxrss (peak since start) is used.
    GPU: torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats.
    extra = peak - baseline - outputs, where baseline is what was held after the inputs
    were allocated and warm-up finished (current RSS / memory_allocated), and outputs are
    the bytes of the returned tensors and gradients of one call.
"""

from __future__ import annotations

import gc
import re
import resource
import statistics
import time

import torch

from .workloads import output_bytes

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is None:  # no /proc: ru_maxrss is the best available figure
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation."""
    xs = sorted(values)
    if not xs:
        raise ValueError("values: empty")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(times_ms: list[float]) -> dict[str, float]:
    return {
        "ms_p20": percentile(times_ms, 20),
        "ms_p50": statistics.median(times_ms),
        "ms_p80": percentile(times_ms, 80),
    }


def measure(
    fn, device: torch.device, repeats: int, warmup=1, warmup_fn=None, after_call=None
) -> dict:
    """Run ``fn`` (returns a list of tensors) after warm-up; time and memory as above.

    warmup_fn: a cheaper call (the same op on a smaller shape) used for warm-up instead of
    ``fn`` when one full call is long (compilation and allocator warm-up happen there).
    after_call: called after each call (clears gradients so that they do not pile up).
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    cuda = device.type == "cuda"
    for _ in range(warmup):
        out = (warmup_fn or fn)()
        del out
        if after_call is not None:
            after_call()
    if cuda:
        torch.cuda.synchronize(device)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        peak_method = "max_memory_allocated"
    else:
        baseline = rss_bytes()
        peak_method = "VmHWM reset" if reset_peak_rss() else "ru_maxrss since start"
    times, cpu_times, out_bytes = [], [], 0
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
            cpu_times.append((time.process_time() - c0) * 1e3)
        out_bytes = max(out_bytes, output_bytes(out))
        del out
        if after_call is not None:
            after_call()
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()
    res = summarize(times)
    res.update(
        peak_bytes=peak,
        baseline_bytes=baseline,
        output_bytes=out_bytes,
        extra_bytes=max(0, peak - baseline - out_bytes),
        peak_method=peak_method,
        times_ms=times,
        cpu_ms_p50=statistics.median(cpu_times) if cpu_times else None,
    )
    return res

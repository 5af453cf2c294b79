"""What a result row records about where it was measured: device, versions, commit, date;
and, on a GPU, the measured ceilings (bf16 matmul TFLOP/s, device copy GB/s).

    python -m bench.envinfo [--ceilings]   prints the report as JSON
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_name()} x{os.cpu_count()} (threads {torch.get_num_threads()})"


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def row_context(device: str) -> dict:
    return {
        "date": now_utc(),
        "commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": version("triton"),
    }


def mem_available_bytes(device: str) -> int:
    """Memory a cell may use: free device memory on a GPU, MemAvailable on the host."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def ceilings(device: str = "cuda", seconds: float = 2.0) -> dict:
    """Measured bf16 matmul TFLOP/s (8192^3) and device-to-device copy GB/s (1 GiB)."""
    dev = torch.device(device)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    src = torch.empty(1 << 29, device=dev, dtype=torch.float16)  # 1 GiB
    dst = torch.empty_like(src)

    def rate(fn, work):
        fn()
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters, best = 0, 0.0
        total = 0.0
        while total < seconds * 1e3 and iters < 200:
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(dev)
            ms = start.elapsed_time(end)
            total += ms
            iters += 1
            best = max(best, work / (ms * 1e-3))
        return best

    tflops = rate(lambda: a @ b, 2.0 * 8192**3) / 1e12
    gbps = rate(lambda: dst.copy_(src), 2.0 * src.numel() * 2) / 1e9  # read + write
    return {"bf16_matmul_tflops": round(tflops, 1), "copy_gb_per_s": round(gbps, 1)}


def report(with_ceilings: bool) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = row_context(dev)
    out.update(
        python=platform.python_version(),
        cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        packages={
            p: version(p)
            for p in ("liger-kernel", "cut-cross-entropy", "verl", "transformers", "numpy")
        },
    )
    if with_ceilings and dev == "cuda":
        out["ceilings"] = ceilings(dev)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.envinfo", description=__doc__)
    ap.add_argument("--ceilings", action="store_true", help="measure matmul and copy rates")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    rep = report(args.ceilings)
    text = json.dumps(rep, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

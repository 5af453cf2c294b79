"""Benchmark suite of mrtpo-kernels: ops x providers x shapes, against what users would use
instead (plain PyTorch, a chunked PyTorch version under torch.compile, Liger-Kernel, Cut
Cross-Entropy, verl), with time, TFLOP/s and memory per cell.

    python -m bench --preset cpu|gpu|smoke [--ops ...] [--providers ...] [--N ...]
    python -m bench.plot --csv results.csv --out DIR

See bench/README.md for the method (FLOP formulas, memory accounting) and the GPU check.
"""

"""Micro-benchmark for the first GPU window (<= 90 s): what each stage of the chunk driver
costs at the target shape, before the full benchmark runs.

    python -m bench.gpu_micro --out micro.json [--n 16384 --d 4096 --v 151936] [--dry-run]

1. correctness first: 512 rows at the target V and d, bf16, ``linear_logprobs`` (with
   entropy and the backward) and ``linear_policy_loss`` on backend "triton" against the
   float64 references (on the GPU); a failure is printed and saved, nothing is timed.
2. cuBLAS at the exact chunk shapes of the driver (C = rows per chunk from
   MRTPO_CHUNK_BYTES, as mrtpo_kernels.stages plans them): logits h_c W^T (fp32 out),
   dh_c = G W, dW += G^T h_c (fp32 accumulator), and the plain bf16 GEMM of the whole op
   (N x d x V) for the ceiling.
3. each Triton row kernel alone on one fp32 chunk (``stages.row_kernel("triton")``):
   stats, grad_, policy_, js_many (K = 4).
Prints one line per figure and writes them all to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _timer(torch, fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def correctness(torch, mk, ref, v, d, rows=512):
    """Max errors against float64 (policy loss, log-probs, entropy, gradients)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, d, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) * d**-0.5).bfloat16().requires_grad_()
    lab = torch.randint(0, v, (rows,), device=dev, generator=g)
    lab[::7] = -100
    out = {}
    lp, ent = mk.linear_logprobs(h, w, lab, return_entropy=True, backend="triton")
    up = torch.randn(rows, device=dev, generator=g)
    gh, gw = torch.autograd.grad((lp * up).sum() + ent.sum(), (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl, re = ref.linear_logprobs_ref(h64, w64, lab, return_entropy=True)
    rh, rw = torch.autograd.grad((rl * up.double()).sum() + re.sum(), (h64, w64))
    out["logp_max_err"] = (lp.double() - rl).abs().max().item()
    out["entropy_max_err"] = (ent.double() - re).abs().max().item()
    out["dh_rel_err"] = ((gh.double() - rh).norm() / rh.norm()).item()
    out["dw_rel_err"] = ((gw.double() - rw).norm() / rw.norm()).item()
    old = rl.detach().float() + 0.2 * torch.randn(rows, device=dev, generator=g)
    adv = torch.randn(rows, device=dev, generator=g)
    loss, _ = mk.linear_policy_loss(h, w, lab, old, adv, backend="triton")
    ph, pw = torch.autograd.grad(loss, (h, w))
    ref_loss = mk.linear_policy_loss(h64, w64, lab, old.double(), adv.double(), backend="torch")[0]
    qh, qw = torch.autograd.grad(ref_loss, (h64, w64))
    out["policy_loss_err"] = abs(loss.item() - ref_loss.item())
    out["policy_dh_rel_err"] = ((ph.double() - qh).norm() / qh.norm()).item()
    out["policy_dw_rel_err"] = ((pw.double() - qw).norm() / qw.norm()).item()
    # bf16 inputs, fp32 math: errors of a few 1e-3 are bf16 rounding of the gradients
    out["ok"] = (
        out["logp_max_err"] < 1e-2
        and out["entropy_max_err"] < 1e-2
        and max(out["dh_rel_err"], out["dw_rel_err"]) < 2e-2
        and max(out["policy_dh_rel_err"], out["policy_dw_rel_err"]) < 2e-2
    )
    return out


def gemms(torch, stages, n, d, v):
    dev = "cuda"
    c = stages.chunk_rows(v)
    bf = torch.bfloat16
    h = torch.randn(c, d, device=dev, dtype=bf)
    w = torch.randn(v, d, device=dev, dtype=bf) * d**-0.5
    z = torch.empty(c, v, device=dev)
    g16 = z.view(bf)[:, :v]
    dh = torch.empty(c, d, device=dev, dtype=bf)
    dw = torch.zeros(v, d, device=dev)
    fl = 2 * c * d * v
    f32 = stages.f32_out_supported(torch.device(dev), bf)
    res = {"chunk_rows": c, "out_dtype_f32": f32}
    if f32:
        res["logits_tflops"] = fl / _timer(torch, lambda: stages.mm_f32(h, w.t(), z)) / 1e12
        res["dh_tflops"] = fl / _timer(torch, lambda: torch.mm(g16, w, out=dh)) / 1e12
        res["dw_tflops"] = fl / _timer(torch, lambda: stages.addmm_f32(dw, g16.t(), h)) / 1e12
    hb = torch.randn(n, d, device=dev, dtype=bf)
    res["full_bf16_gemm_tflops"] = 2 * n * d * v / _timer(torch, lambda: hb @ w.t(), 3) / 1e12
    return res


def row_kernels(torch, stages, v):
    dev = "cuda"
    c = stages.chunk_rows(v)
    k = stages.row_kernel("triton")
    z = torch.randn(c, v, device=dev) * 2
    lab = torch.randint(0, v, (c,), device=dev)
    one = torch.ones(c, device=dev)
    gb = 4 * c * v / 1e9
    res = {}
    t = _timer(torch, lambda: k.stats(z, lab, 1.0, -100, True))
    res["stats_ms"], res["stats_gbps"] = t * 1e3, gb / t
    _, _, lse = k.stats(z, lab, 1.0, -100, False)
    zz = z.clone()
    t = _timer(torch, lambda: k.grad_(zz, lab, lse, None, one, None, 1.0, -100))
    res["grad_ms"], res["grad_gbps"] = t * 1e3, 3 * gb / t
    out16 = zz.view(torch.bfloat16)[:, :v]
    t = _timer(
        torch, lambda: k.policy_(zz, lab, one, one, one, None, 1.0, 0.2, 0.2, 0.0, -100, True,
                                 out=out16)
    )  # fmt: skip
    res["policy_ms"], res["policy_gbps"] = t * 1e3, 2.5 * gb / t
    zs_rows = max(1, c // 5)
    zs = torch.randn(5, zs_rows, v, device=dev)
    t = _timer(torch, lambda: k.js_many(zs, 1.0))
    res["js_many_k4_ms"], res["js_many_gbps"] = t * 1e3, 2 * 4 * 5 * zs_rows * v / 1e9 / t
    return res


def plan(stages, n, d, v, k=4):
    """What the chunk driver will run at this shape (no GPU needed): rows per chunk, kept
    rows, GEMM count and TFLOP per op, so each measured time has its GEMM work beside it."""
    out = {}
    for name, kw in (
        ("linear_logprobs_fwd_bwd", {"op": "linear_logprobs"}),
        ("linear_policy_loss_fwd_bwd", {"op": "linear_policy_loss"}),
        ("linear_js_distance_k4", {"op": "linear_js_distance", "k": k}),
    ):
        p = stages.chunk_plan(n=n, v=v, d=d, **kw)
        out[name] = {
            "rows_per_chunk": p.rows_per_chunk,
            "kept_rows": p.kept_rows,
            "gemms": p.count(),
            "tflop": round(p.flops / 1e12, 2),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_micro", description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--dry-run", action="store_true", help="check imports and arguments only")
    args = ap.parse_args(argv)
    import torch

    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as ref
    from mrtpo_kernels import stages

    if args.dry_run:
        print(f"gpu_micro: would measure N={args.n} d={args.d} V={args.v} into {args.out}")
        print(f"gpu_micro: plan {json.dumps(plan(stages, args.n, args.d, args.v))}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_micro: no CUDA device", file=sys.stderr)
        return 2
    result = {"shape": {"N": args.n, "d": args.d, "V": args.v}, "torch": torch.__version__}
    result["plan"] = plan(stages, args.n, args.d, args.v)
    print(f"[micro] plan: {json.dumps(result['plan'])}", flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for name, fn in (
        ("correctness_512", lambda: correctness(torch, mk, ref, args.v, args.d)),
        ("cublas", lambda: gemms(torch, stages, args.n, args.d, args.v)),
        ("row_kernels", lambda: row_kernels(torch, stages, args.v)),
    ):
        t0 = time.time()
        try:
            result[name] = fn()
        except Exception as exc:  # report and keep what was measured
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        result[name]["seconds"] = round(time.time() - t0, 1)
        print(f"[micro] {name}: {json.dumps(result[name])}", flush=True)
        save()
        if name == "correctness_512" and not result[name].get("ok"):
            print("[micro] correctness failed: nothing timed", flush=True)
            return 1
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Presets: which ops, providers and shapes a run covers.

V = 151936 (Qwen2/2.5 vocabulary). GPU: bf16, d in {896, 4096} (Qwen2.5-0.5B and 7B
hidden sizes), N in {1024, 4096, 16384, 65536}. CPU: fp32, d = 896, N in {1024, 4096,
16384}. The advantage stage: 4096 responses x 4096 tokens, K = 4 on the GPU; 1024 x 1024
on the CPU. JS: K in {1, 4}. The credit-assignment step uses K = 4 and 1024-token responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .providers import BASELINES, FLOOR, OURS, PEERS
from .workloads import WORKLOADS

VOCAB = 151936


@dataclass
class Preset:
    name: str
    device: str
    dtype: str
    ds: tuple[int, ...]
    ns: tuple[int, ...]
    ops: tuple[str, ...] = WORKLOADS
    providers: tuple[str, ...] = ()
    v: int = VOCAB
    js_ks: tuple[int, ...] = (1, 4)
    step_k: int = 4
    step_seqlen: int = 1024
    adv_shape: tuple[int, int, int] = (4096, 4096, 4)  # responses, tokens each, K
    repeats: dict[int, int] = field(default_factory=dict)  # N -> repeats (default 5)
    warmup_n: int = 0  # warm up on this many tokens instead of a full call (CPU, long cells)
    isolate: str = "cell"  # cell | provider | none
    cell_timeout_s: float = 3600.0

    def repeats_for(self, n: int) -> int:
        return self.repeats.get(n, 5)


PRESETS = {
    "cpu": Preset(
        name="cpu",
        device="cpu",
        dtype="float32",
        ds=(896,),
        ns=(1024, 4096, 16384),
        providers=("mrtpo-cpu", "mrtpo-torch") + BASELINES + (FLOOR,) + PEERS,
        adv_shape=(1024, 1024, 4),
        repeats={1024: 3, 4096: 3, 16384: 1},
        warmup_n=256,
        isolate="cell",
        cell_timeout_s=1800.0,
    ),
    "gpu": Preset(
        name="gpu",
        device="cuda",
        dtype="bfloat16",
        ds=(896, 4096),
        ns=(1024, 4096, 16384, 65536),
        providers=("mrtpo-triton", "mrtpo-cuda") + BASELINES + (FLOOR,) + PEERS,
        repeats={65536: 3, 16384: 5},
        isolate="provider",
        cell_timeout_s=600.0,
    ),
    # the shapes of issue 3's targets, for bench/gpu_check.sh (a few minutes at most)
    "gpu-target": Preset(
        name="gpu-target",
        device="cuda",
        dtype="bfloat16",
        ds=(4096,),
        ns=(16384,),
        ops=(
            "linear_policy_loss_fwd_bwd",
            "linear_js_distance",
            "linear_logprobs_fwd_bwd",
            "advantages",
            "credit_assignment_step",
        ),
        providers=("mrtpo-triton", "mrtpo-cuda", FLOOR, "pytorch") + PEERS + ("pytorch-compiled",),
        js_ks=(4,),
        repeats={16384: 5},
        isolate="provider",
        cell_timeout_s=300.0,
    ),
    # tiny shapes for the tests: seconds, in one process
    "smoke": Preset(
        name="smoke",
        device="cpu",
        dtype="float32",
        ds=(32,),
        ns=(64, 128),
        v=1000,
        providers=("mrtpo-torch", "pytorch", "liger"),
        js_ks=(1, 2),
        step_k=2,
        step_seqlen=32,
        adv_shape=(16, 32, 2),
        repeats={64: 3, 128: 3},
        isolate="none",
        cell_timeout_s=300.0,
    ),
}


def cells(
    preset: Preset,
    ops=None,
    providers=None,
    ns=None,
    ds=None,
    repeats=None,
    seed: int = 0,
    js_ks=None,
) -> list[dict]:
    """Cell specs: ops x shapes x providers (providers innermost, so that rows compared in
    the table are measured one after the other)."""
    ops = tuple(ops or preset.ops)
    providers = tuple(providers or preset.providers)
    for p in providers:
        if p not in OURS + BASELINES + (FLOOR,) + PEERS:
            raise ValueError(f"providers: unknown {p!r}")
    for op in ops:
        if op not in WORKLOADS:
            raise ValueError(f"ops: unknown {op!r}; expected some of {', '.join(WORKLOADS)}")
    ns = tuple(ns or preset.ns)
    ds = tuple(ds or preset.ds)
    out = []
    for op in ops:
        if op == "advantages":
            nr, t, k = preset.adv_shape
            shapes = [(nr * t, 0, 0, k, nr)]
        else:
            ks = (
                tuple(js_ks or preset.js_ks)
                if op == "linear_js_distance"
                else ((preset.step_k,) if op == "credit_assignment_step" else (0,))
            )
            shapes = []
            for d in ds:
                for n in ns:
                    for k in ks:
                        nr = (
                            max(1, n // preset.step_seqlen) if op == "credit_assignment_step" else 0
                        )
                        shapes.append((n, d, preset.v, k, nr))
        for n, d, v, k, nr in shapes:
            for p in providers:
                out.append(
                    {
                        "op": op,
                        "provider": p,
                        "n": n,
                        "d": d,
                        "v": v,
                        "k": k,
                        "responses": nr,
                        "dtype": preset.dtype,
                        "device": preset.device,
                        "repeats": repeats or preset.repeats_for(n),
                        "warmup": 1,
                        "warmup_n": preset.warmup_n
                        if preset.warmup_n and n > preset.warmup_n
                        else 0,
                        "seed": seed,
                    }
                )
    return out

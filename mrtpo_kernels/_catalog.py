"""The catalog of the public ops, ``OPS`` (the op table): for each public function, the
backend entry points it calls, where each backend's kernel lives, its float64 reference,
its tests and the benchmark workloads that time it.

Every backend that serves an op defines all of the op's entry points under these names
(signatures: the Protocols of ``mrtpo_kernels/backends/contract.py``) and says in its
``SERVES`` which devices and dtypes it takes; the dispatcher reads both. The docs' "Backends and
settings" page shows this table (``markdown()``, filled in at each build of the site).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Op:
    """One public op of mrtpo_kernels.

    name:            the public function, ``mrtpo_kernels.<name>``
    entry_points:    the backend functions it calls (same names on every backend, named
                     after the op)
    kernels:         backend -> where that backend's kernel is (the file to read)
    reference:       the float64 reference, ``mrtpo_kernels.reference.<reference>``
    tests:           the test files, first the op's own (CPU, fuzz, Triton interpreter
                     and GPU checks: tests/test_<op>.py)
    bench_workloads: the benchmark workloads (bench/workloads.py, ``python -m bench
                     --ops ...``) that time it
    logit_cap:       the op takes the LM head's logit transform (``logit_scale``,
                     ``softcap``: _types.LogitCap) on every backend it has; the ops from
                     existing logits take them as they are (a model's final logits)
    """

    name: str
    entry_points: tuple[str, ...]
    kernels: Mapping[str, str]
    reference: str
    tests: tuple[str, ...]
    bench_workloads: tuple[str, ...] = field(default=())
    logit_cap: bool = False

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends with a kernel for this op."""
        return tuple(self.kernels)


_TORCH = "mrtpo_kernels/backends/torch_backend.py"
_CPU_ROWS = "csrc/cpu/row_kernels.h"
_TRITON_ROWS = "mrtpo_kernels/triton_kernels/rows.py"


def _chunk_driven(driver: str) -> dict[str, str]:
    """The kernels of an op of the chunk driver (backends/_chunked.py gathers its entry
    points; ``driver`` the op's own module there) on each backend that runs it: the driver
    with the backend's row kernels (on "triton", the one Triton path)."""
    path = f"mrtpo_kernels/backends/{driver}"
    return {
        "torch": f"{path} + {_TORCH}",
        "cpu": f"{path} + {_CPU_ROWS}",
        "triton": f"{path} + {_TRITON_ROWS}",
    }


def _op(name, entry_points, kernels, reference, tests, bench_workloads=(), logit_cap=False):
    return Op(
        name,
        entry_points,
        MappingProxyType(dict(kernels)),
        reference,
        tests,
        bench_workloads,
        logit_cap,
    )


OPS: Mapping[str, Op] = MappingProxyType(
    {
        op.name: op
        for op in (
            _op(
                "linear_logprobs",
                ("linear_logprobs_fwd", "linear_logprobs_bwd"),
                _chunk_driven("_chunked_logprobs.py"),
                "linear_logprobs_ref",
                ("tests/test_logprobs.py", "tests/test_logit_cap.py"),
                ("linear_logprobs_fwd", "linear_logprobs_entropy", "linear_logprobs_fwd_bwd"),
                logit_cap=True,
            ),
            _op(
                "logprobs_from_logits",
                ("logprobs_from_logits_fwd", "logprobs_from_logits_bwd"),
                _chunk_driven("_chunked_logprobs.py") | {"cuda": "csrc/cuda/logprobs.cu"},
                "logprobs_from_logits_ref",
                ("tests/test_logprobs.py",),
            ),
            _op(
                "linear_js_distance",
                ("linear_js_distance",),
                _chunk_driven("_chunked_js.py"),
                "linear_js_distance_ref",
                ("tests/test_js.py", "tests/test_logit_cap.py"),
                ("linear_js_distance", "credit_assignment_step"),
                logit_cap=True,
            ),
            _op(
                "js_distance",
                ("js_distance",),
                _chunk_driven("_chunked_js.py") | {"cuda": "csrc/cuda/js.cu"},
                "js_distance_ref",
                ("tests/test_js.py",),
            ),
            _op(
                "linear_policy_loss",
                ("linear_policy_loss",),
                _chunk_driven("_chunked_policy.py"),
                "linear_policy_loss_ref",
                ("tests/test_policy_loss.py", "tests/test_logit_cap.py"),
                ("linear_policy_loss_fwd_bwd", "credit_assignment_step"),
                logit_cap=True,
            ),
            _op(
                "gdpo_advantages",
                (),  # a few O(n K) reductions in PyTorch ops, in the public function itself
                {"torch": "mrtpo_kernels/advantages.py"},
                "gdpo_advantages_ref",
                ("tests/test_advantages.py", "tests/test_bench_advantages.py"),
            ),
            _op(
                "mrtpo_token_advantages",
                ("mrtpo_token_advantages",),
                {
                    "torch": _TORCH,
                    "triton": "mrtpo_kernels/triton_kernels/advantages.py",
                    "cuda": "csrc/cuda/advantages.cu",
                },
                "mrtpo_token_advantages_ref",
                (
                    "tests/test_advantages.py",
                    "tests/test_bench_advantages.py",
                ),
                ("advantages",),  # credit_assignment_step runs it on the auto backend
            ),
            _op(
                "specific_relevance",
                (),  # a few elementwise ops and a (K, K) matmul, in the public function itself
                {"torch": "mrtpo_kernels/advantages.py"},
                "specific_relevance_ref",
                ("tests/test_relevance.py",),
            ),
        )
    }
)


def markdown() -> str:
    """The table as Markdown (docs/backends.md shows this)."""
    backends = ("torch", "cpu", "triton", "cuda")
    lines = [
        "| op | entry points | "
        + " | ".join(backends)
        + " | reference | logit_scale, softcap | tests | bench workloads |",
        "|---" * (7 + len(backends) - 1) + "|",
    ]
    for op in OPS.values():
        cells = [f"`{op.name}`", ", ".join(f"`{e}`" for e in op.entry_points) or "-"]
        cells += [f"`{op.kernels[b]}`" if b in op.kernels else "-" for b in backends]
        cells += [
            f"`{op.reference}`",
            "yes" if op.logit_cap else "-",
            ", ".join(f"`{t}`" for t in op.tests),
            ", ".join(f"`{b}`" for b in op.bench_workloads) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

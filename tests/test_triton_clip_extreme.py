"""Two numerics rules of the Triton kernels, checked against the float64 reference under the
Triton interpreter; TRITON_INTERPRET=1 must be set before triton is imported, so the checks
live in tests/triton_cases/clip_extreme_cases.py and run here in a subprocess per group:

clip: the clipped flag, loss and gradient follow reference.policy_loss_ref (ties and NaN
    included) in every Triton kernel, on both Triton paths (the chunk driver and its
    low-memory mode; the CPU backends: tests/test_policy_clip_rule.py);
extreme: the public ops over several chunks, and the low-memory column kernel, keep the row
    kernels' accuracy at large |z / tau| (log p from each row's raw max and log s, not the
    rounded lse).
See the cases file for what each group checks.
"""

from __future__ import annotations

from triton_cases._harness import CASES, interpreted, run_interpreted

SCRIPT = CASES / "clip_extreme_cases.py"


@interpreted
def test_triton_clip_flag_follows_reference_under_interpreter():
    run_interpreted(SCRIPT, "clip")


@interpreted
def test_triton_extreme_logits_under_interpreter():
    run_interpreted(SCRIPT, "extreme")

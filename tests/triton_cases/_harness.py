"""The one harness of the Triton interpreter checks (TRITON_INTERPRET=1 must be set before
triton is imported, so the checks run as scripts in a subprocess of their own).

An op's interpreter cases live in its test module (tests/test_<op>.py): functions named
``group_<name>`` gathered in a module-level dict GROUPS. This module, run as a script,
switches the interpreter on and only then imports that test module and runs its groups:

    python tests/triton_cases/_harness.py tests/test_<op>.py [GROUP ...]   (default: all)

pytest side (tests/test_<op>.py, test_chunk_driver.py, test_numerics_extreme.py, ...):
    run_groups(test_file, *groups, env=None)   the groups of a test module, as above
    run_interpreted(*argv, env=None)   ``python *argv`` under the interpreter; asserts exit
                                       status 0 and a last summary line of 0 failures
    interpreted(fn)                    marks a test ``triton`` and skips it without triton
                                       (``make test-triton`` runs the marked tests alone)

script side (the groups of a test module; the cases files tests/triton_cases/*_cases.py
shared by several ops, which import this module and call use_interpreter() before torch
or triton is imported):
    close(name, ours, want, same=None, *, atol, rtol)   the error rule against float64
    expect(name, cond, detail)                          a plain check
    opcheck(name, op, args)                             torch.library.opcheck
    compile_check(name, fn, args)                       torch.compile(fullgraph) == eager
    policy_token_reference(...)                         the clip rule per token, float64
    env(**kv)                                           MRTPO_* variables for a block
    run(groups, argv)                                   run named groups, print, exit code
FAILURES and CHECKS collect the results of every check of the process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "triton_cases"

FAILURES: list[str] = []
CHECKS = [0]

# the summary line every script prints last: "<n> checks, <k> failures" (or "<k> failures")
_SUMMARY = re.compile(r"^(?:\d+ checks, )?(\d+) failures$", re.MULTILINE)
_COUNT = re.compile(r"^(\d+) checks, \d+ failures$", re.MULTILINE)


# --------------------------------------------------------------------------- pytest side


def needs_triton(fn):
    """Skip a test (a pytest decorator) where triton is not installed."""
    import importlib.util

    import pytest

    missing = importlib.util.find_spec("triton") is None
    return pytest.mark.skipif(missing, reason="triton is not installed")(fn)


def interpreted(fn):
    """A test that runs Triton-interpreter checks in a subprocess: marked ``triton`` and
    skipped where triton is not installed."""
    import pytest

    return pytest.mark.triton(needs_triton(fn))


def run_groups(test_file, *groups, env: dict | None = None, timeout: float = 900) -> str:
    """Run the interpreter case groups of a test module (all by default) in a subprocess
    (``python tests/triton_cases/_harness.py test_file *groups``); see run_interpreted."""
    return run_interpreted(Path(__file__), Path(test_file), *groups, env=env, timeout=timeout)


def run_interpreted(*argv, env: dict | None = None, timeout: float = 900) -> str:
    """Run ``python *argv`` (a script and its arguments, or "-c", code) from the repository
    root with TRITON_INTERPRET=1, one OpenMP thread, MRTPO_STRICT_BACKEND=1 and the root
    and tests/ on PYTHONPATH; ``env`` overrides variables (None removes one). Asserts exit
    status 0 and that the last summary line counts 0 failures; returns stdout."""
    full = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MRTPO_STRICT_BACKEND="1")
    full["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests")] + ([full["PYTHONPATH"]] if full.get("PYTHONPATH") else [])
    )
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = str(value)
    proc = subprocess.run(
        [sys.executable, *map(str, argv)],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"interpreter checks: exit status {proc.returncode}\n{out}"
    found = _SUMMARY.findall(proc.stdout)
    if os.environ.get("MRTPO_CHECKS_LOG"):  # the check count of every run, for a tally
        last = [ln for ln in proc.stdout.splitlines() if _SUMMARY.match(ln)][-1:]
        with open(os.environ["MRTPO_CHECKS_LOG"], "a") as log:
            log.write(f"{' '.join(map(str, argv))[:120]!r} {last}\n")
    assert found and found[-1] == "0", f"no summary line with 0 failures:\n{out}"
    counts = _COUNT.findall(proc.stdout)
    assert not counts or int(counts[-1]) > 0, f"the summary counts 0 checks:\n{out}"
    return proc.stdout


# --------------------------------------------------------------------------- script side


def use_interpreter() -> None:
    """Switch the Triton interpreter on (before triton is imported), make a fallback to
    another backend an error, and put the repository root on sys.path."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["MRTPO_STRICT_BACKEND"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import warnings

    # both arms of tl.where are evaluated in numpy: masked lanes warn (inf - inf, exp overflow)
    warnings.filterwarnings("ignore", category=RuntimeWarning)


def close(name, ours, want, same=None, *, atol=1e-5, rtol=1e-5):
    """The error rule against float64 (README "Numerics"):
    - the shapes are equal;
    - every non-finite entry of ``want`` is matched exactly: NaN by NaN (never by a 0 or
      another number), +-inf by the same infinity;
    - where ``want`` is finite, ``ours`` is finite and
      max |ours - want| <= 2 max |same - want| + atol + rtol max |want|,
      ``same`` being plain PyTorch in the input dtype (its error taken where it is finite;
      None: no such term)."""
    import torch

    CHECKS[0] += 1
    ours, want = ours.detach().double(), want.detach().double()
    if ours.shape != want.shape:
        FAILURES.append(f"{name}: shape {tuple(ours.shape)} != {tuple(want.shape)}")
        return
    fin = torch.isfinite(want)
    nan = torch.isnan(want)
    inf = ~fin & ~nan
    n_nan = int((~torch.isnan(ours[nan])).sum())
    n_inf = int((ours[inf] != want[inf]).sum())
    if n_nan or n_inf:
        FAILURES.append(
            f"{name}: {n_nan} NaN and {n_inf} infinite reference entries not matched "
            f"(ours there: {ours[~fin][:6].tolist()}, reference {want[~fin][:6].tolist()})"
        )
        return
    if not bool(torch.isfinite(ours[fin]).all()):
        bad = ours[fin][~torch.isfinite(ours[fin])]
        FAILURES.append(f"{name}: {bad.numel()} non-finite values where the reference is finite")
        return
    if not bool(fin.any()):
        return
    err = (ours[fin] - want[fin]).abs().max().item()
    base = 0.0
    if same is not None:
        same = same.detach().double()
        both = fin & torch.isfinite(same)
        base = (same[both] - want[both]).abs().max().item() if bool(both.any()) else 0.0
    bound = 2.0 * base + atol + rtol * want[fin].abs().max().item()
    if not err <= bound:
        FAILURES.append(f"{name}: max error {err:.3e} > bound {bound:.3e} (torch {base:.3e})")


def expect(name, cond, detail=""):
    CHECKS[0] += 1
    if not cond:
        FAILURES.append(f"{name}: {detail}")


def compile_check(name, fn, args):
    """torch.compile(fn, fullgraph=True, backend="aot_eager")(*args) equals fn(*args)."""
    import torch

    CHECKS[0] += 1
    try:
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        want = fn(*args)
        if not torch.allclose(got, want, atol=1e-6, rtol=1e-6):
            FAILURES.append(f"compile {name}: compiled {got} != eager {want}")
    except Exception as exc:
        FAILURES.append(f"compile {name}: {type(exc).__name__}: {str(exc)[:600]}")


def opcheck(name, op, args):
    """torch.library.opcheck(op, args); a failure is recorded with the opcheck test that
    failed."""
    import torch

    CHECKS[0] += 1
    try:
        torch.library.opcheck(op, args)
    except Exception as exc:
        FAILURES.append(f"opcheck {name}: {type(exc).__name__}: {str(exc)[:400]}")


def policy_token_reference(logp, old, adv, labels, clip_low, clip_high, clip_c, beta, ref_lp):
    """Per token (loss, clipped, dloss/dlogp) of reference.policy_loss_ref on that token
    alone, in float64 with the gradient by its autograd (0, 0, 0 on an ignored token,
    label -100); clip_c None: no dual clip; beta 0: no KL term (ref_lp unused). The rule
    every backend's clip follows (tests/test_policy_clip_rule.py, clip_extreme_cases.py)."""
    import torch

    from mrtpo_kernels.reference import policy_loss_ref

    out = []
    for i in range(logp.shape[0]):
        if labels[i] == -100:
            out.append((0.0, 0.0, 0.0))
            continue
        lp = logp[i : i + 1].double().requires_grad_()
        kw = dict(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_c)
        if beta:
            kw.update(ref_logprobs=ref_lp[i : i + 1].double(), beta=beta)
        one = torch.ones(1, dtype=torch.bool)
        loss, met = policy_loss_ref(lp, old[i : i + 1].double(), adv[i : i + 1].double(), one, **kw)
        (g,) = torch.autograd.grad(loss, lp)
        out.append((loss.item(), met["clip_fraction"].item(), g.item()))
    return torch.tensor(out, dtype=torch.float64).unbind(1)


ENV_KEYS = (
    "MRTPO_LOW_MEMORY",
    "MRTPO_OVERLAP_ROWS",
    "MRTPO_CHUNK_BYTES",
    "MRTPO_GRAD_BUFFER_BYTES",
    "MRTPO_JS_SCRATCH_BYTES",
    "MRTPO_KEEP_LOGITS_BYTES",
    "MRTPO_SKIP_VALUE_CHECKS",
)


class env:
    """Set MRTPO_* variables for a block, restoring every one of ENV_KEYS after it."""

    def __init__(self, **kv):
        self.kv = {k: str(v) for k, v in kv.items()}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in ENV_KEYS}
        os.environ.update(self.kv)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(groups: dict, argv: list[str]) -> int:
    """Run the named groups (all by default; a group is a function or a tuple of them),
    print one line each, the summary "<n> checks, <k> failures" and the failures; 0 when
    every check passed, 1 otherwise (a function that ran no check is a failure), 2 for an
    unknown group name."""
    names = list(argv) or list(groups)
    unknown = [n for n in names if n not in groups]
    if unknown:
        print(f"unknown group(s) {', '.join(map(repr, unknown))}; known: {', '.join(groups)}")
        return 2
    for name in names:
        fns = groups[name] if isinstance(groups[name], tuple) else (groups[name],)
        for fn in fns:
            label = name if len(fns) == 1 else f"{name}: {fn.__name__}"
            before, checks, t0 = len(FAILURES), CHECKS[0], time.time()
            try:
                fn()
            except Exception as exc:
                FAILURES.append(f"{label} raised {type(exc).__name__}: {exc}")
            else:
                if CHECKS[0] == checks:  # a group that checks nothing passes nothing
                    FAILURES.append(f"{label} ran no check")
            status = "ok" if len(FAILURES) == before else "FAIL"
            print(f"{status} {label} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{CHECKS[0]} checks, {len(FAILURES)} failures")
    for line in FAILURES:
        print("FAIL", line)
    return 1 if FAILURES else 0


def main(argv: list[str]) -> int:
    """Script side of run_groups: switch the interpreter on, then import the test module
    ``argv[0]`` (a path) and run its GROUPS named in ``argv[1:]``."""
    import importlib.util

    use_interpreter()
    # the cases files import this module as plain ``_harness`` (their folder on sys.path):
    # one copy, so that their checks and failures are the ones ``run`` counts
    sys.modules["_harness"] = sys.modules[__name__]
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    path = Path(argv[0]).resolve()
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return run(module.GROUPS, argv[1:])


if __name__ == "__main__":
    # the module as imported by the test modules (this file runs as __main__: a second copy
    # would count the checks apart)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from triton_cases import _harness

    sys.exit(_harness.main(sys.argv[1:]))

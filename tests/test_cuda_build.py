"""The CUDA extension mrtpo_kernels._cuda (csrc/cuda).

Without a GPU (every machine with nvcc):
- the device headers are torch-free;
- one nvcc -arch=sm_90 call compiles tests/cuda_harness/kernels_check.cu, which instantiates
  every kernel template for float, bf16 and fp16 and runs the kernels' per-thread code on the
  CPU against float64 (see that file); it must compile without warnings or register spills
  and pass;
- one nvcc call compiles the torch-free launchers (csrc/cuda/*.cu) as setup.py does;
- the bindings (the one file with torch) pass a syntax-only C++ compile against the torch
  headers, where those ship the c10/cuda headers;
- on a machine without the extension or a GPU, the "cuda" backend reports why and the
  dispatcher falls back to "torch".
The three compiles run in parallel, started once per module.

On the GPU machine (`@pytest.mark.gpu`): each op through the public API with backend="cuda"
(strict: a fallback fails the test) against the float64 reference at V = 151936, within the
error budget of conftest.assert_within_budget.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import assert_within_budget

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc" / "cuda"
HARNESS = Path(__file__).resolve().parent / "cuda_harness" / "kernels_check.cu"


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


NVCC = _find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, CUDA_HOME)")

# As setup.py builds the extension (its flags and those torch's CUDAExtension adds), plus
# warnings and spill reports.
NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
    "-Xcompiler",
    "-fPIC",
    "-O3",
    "-std=c++17",
    "--use_fast_math",
    "-arch=sm_90",
    "-Xcompiler",
    "-Wall,-Wextra",
    "-Xptxas",
    "-warn-spills,-warn-lmem-usage",
    f"-I{CSRC}",
]
COMPILE_TIMEOUT_S = 600

ALLOWED_INCLUDE = re.compile(
    r"^\s*#\s*include\s*(<(cuda_runtime|cuda_runtime_api|cuda_fp16|cuda_bf16)\.h>"
    r'|<c[a-z]+>|<(cstdint|cmath|cstddef|limits|type_traits|utility)>|"[a-z_]+\.(cuh|h)")'
)


def _torch_free_sources() -> list[Path]:
    return sorted(CSRC.glob("*.cuh")) + sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.h"))


class _Job:
    """A compile started in the background; result() waits for it."""

    def __init__(self, cmd: list[str], cwd: Path):
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._out: str | None = None

    def result(self) -> tuple[int, str]:
        if self._out is None:
            try:
                self._out, _ = self.proc.communicate(timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self._out = self.proc.communicate()[0] + "\n[timed out]"
        return self.proc.returncode, self._out


def _torch_include_flags() -> list[str] | None:
    """-isystem flags for a syntax-only compile of bindings.cpp, or None where the torch
    headers lack the c10/cuda headers or the CUDA headers are not found."""
    from torch.utils import cpp_extension

    incs = cpp_extension.include_paths()
    if not any((Path(i) / "c10" / "cuda" / "CUDAStream.h").is_file() for i in incs):
        return None
    homes = [os.environ.get("CUDA_HOME"), str(Path(NVCC).resolve().parents[1]), "/usr/local/cuda"]
    cuda_inc = [h for h in homes if h and (Path(h) / "include" / "cuda_runtime.h").is_file()]
    if not cuda_inc:
        return None
    flags = []
    for inc in [*incs, f"{cuda_inc[0]}/include", sysconfig.get_paths()["include"]]:
        flags += ["-isystem", inc]
    return flags


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Start the three compiles at once; tests wait on the one they check."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("cuda_build")
    jobs = {
        "harness": _Job([NVCC, *NVCC_FLAGS, str(HARNESS), "-o", str(out / "kernels_check")], out),
        "launchers": _Job(
            [NVCC, *NVCC_FLAGS, "-c", *map(str, sorted(CSRC.glob("*.cu"))), "-odir", str(out)],
            out,
        ),
    }
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    inc = _torch_include_flags()
    if cxx and inc is not None:
        jobs["bindings"] = _Job(
            [
                cxx,
                "-std=c++17",
                "-fsyntax-only",
                "-Wall",
                "-Wextra",
                "-DTORCH_EXTENSION_NAME=_cuda",
                # The CPU wheel of torch ships c10/cuda without its generated macros header.
                "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
                *inc,
                f"-I{CSRC}",
                str(CSRC / "bindings.cpp"),
            ],
            out,
        )
    yield out, jobs
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def _our_warnings(output: str) -> list[str]:
    """Warning / error lines of the compile output (nvcc, ptxas, host compiler)."""
    return [
        line
        for line in output.splitlines()
        if re.search(r"\b(warning|error)\b", line, re.IGNORECASE) and "ptxas info" not in line
    ]


def test_device_code_is_torch_free():
    sources = _torch_free_sources()
    assert any(p.suffix == ".cuh" for p in sources), "no device headers in csrc/cuda"
    bad = []
    for path in sources:
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#include") and not ALLOWED_INCLUDE.match(line):
                bad.append(f"{path.name}: {line.strip()}")
    assert not bad, "device code must include only CUDA runtime / fp16 / bf16 / std headers:\n" + (
        "\n".join(bad)
    )


@needs_nvcc
def test_harness_compiles_every_kernel_without_warnings(builds):
    _, jobs = builds
    rc, output = jobs["harness"].result()
    assert rc == 0, f"nvcc failed on the kernel harness:\n{output[-6000:]}"
    assert not _our_warnings(output), "\n".join(_our_warnings(output))


@needs_nvcc
def test_harness_cpu_checks_pass(builds):
    out, jobs = builds
    rc, output = jobs["harness"].result()
    assert rc == 0, f"nvcc failed on the kernel harness:\n{output[-6000:]}"
    run = subprocess.run([str(out / "kernels_check")], capture_output=True, text=True, timeout=300)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"kernel checks failed:\n{run.stdout[-6000:]}{run.stderr}"
    match = re.fullmatch(r"(\d+) checks, 0 failed", summary)
    assert match and int(match.group(1)) > 1000, f"unexpected summary: {summary!r}"


@needs_nvcc
def test_launchers_compile_without_warnings(builds):
    out, jobs = builds
    rc, output = jobs["launchers"].result()
    assert rc == 0, f"nvcc failed on the launchers:\n{output[-6000:]}"
    assert not _our_warnings(output), "\n".join(_our_warnings(output))
    for src in CSRC.glob("*.cu"):
        assert (out / (src.stem + ".o")).is_file(), f"no object for {src.name}"


@needs_nvcc
def test_bindings_pass_a_syntax_check(builds):
    _, jobs = builds
    if "bindings" not in jobs:
        pytest.skip("no C++ compiler, torch headers without c10/cuda, or no CUDA headers")
    rc, output = jobs["bindings"].result()
    assert rc == 0, f"bindings.cpp does not compile:\n{output[-6000:]}"
    ours = [line for line in _our_warnings(output) if "bindings.cpp" in line]
    assert not ours, "\n".join(ours)


_FALLBACK_SCRIPT = r"""
import warnings
import torch
import mrtpo_kernels as mk
status = mk.backend_status()["cuda"]
assert status != "ok", status
assert "mrtpo_kernels._cuda" in status or "CUDA device" in status, status
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    chosen = mk.resolve_backend("js_distance", "cuda", backend="cuda")
assert chosen == "torch", chosen
msgs = [str(w.message) for w in caught]
assert len(msgs) == 1 and "'cuda'" in msgs[0] and "_cuda" in msgs[0], msgs
assert mk.resolve_backend("js_distance", "cuda") in ("triton", "torch")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the backend may load")
def test_cuda_backend_reports_why_it_is_unavailable_and_dispatch_falls_back():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MRTPO_STRICT_BACKEND": "0"}
    run = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the backend may load")
def test_strict_mode_turns_the_fallback_into_an_error(monkeypatch):
    import mrtpo_kernels as mk

    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "1")
    with pytest.raises(RuntimeError, match="cuda"):
        mk.resolve_backend("logprobs_from_logits", "cuda", backend="cuda")


def test_cuda_backend_matches_the_backend_interface():
    # The module imports without the extension; its ops take the torch backend's arguments.
    import inspect

    from mrtpo_kernels.backends import cuda_backend, torch_backend

    ops = (
        "logprobs_from_logits_fwd",
        "logprobs_from_logits_bwd",
        "js_distance",
        "mrtpo_token_advantages",
    )
    for op in ops:
        ours = list(inspect.signature(getattr(cuda_backend, op)).parameters)
        theirs = list(inspect.signature(getattr(torch_backend, op)).parameters)
        assert len(ours) == len(theirs), f"{op}: {ours} vs {theirs}"
    assert isinstance(cuda_backend.available(), bool)
    if not cuda_backend.available():
        assert cuda_backend.unavailable_reason()


def test_cuda_backend_calls_the_bindings_by_their_argument_names():
    """Every launch in cuda_backend passes keyword arguments, and they are exactly the
    py::arg names of that function in csrc/cuda/bindings.cpp (checked without building)."""
    import ast

    src = (CSRC / "bindings.cpp").read_text()
    bound = {}
    for m in re.finditer(r'm\.def\("(\w+)",(.*?)\);', src, re.S):
        bound[m.group(1)] = re.findall(r'py::arg\("(\w+)"\)', m.group(2))
    tree = ast.parse((ROOT / "mrtpo_kernels" / "backends" / "cuda_backend.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "_cuda"
    ]
    assert {c.func.attr for c in calls} == set(bound) and bound
    for call in calls:
        assert not call.args, f"{call.func.attr}: positional arguments"
        assert [k.arg for k in call.keywords] == bound[call.func.attr], call.func.attr


# =========================================================================== GPU tests

V_REAL = 151936  # Qwen2 vocabulary


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mrtpo_kernels import backends

    if backends.load("cuda") is None:
        pytest.fail(f"the cuda backend does not load: {backends.load_error('cuda')}")


@pytest.fixture
def strict(monkeypatch):
    """Any fallback away from the requested backend is an error, not a warning."""
    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "1")


def _logits(n, v, dtype, seed, scale=3.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(n, v, device="cuda", generator=gen) * scale
    return z.to(dtype)


def _labels(n, v, seed, ignore_every=5):
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    lab = torch.randint(0, v, (n,), device="cuda", generator=gen)
    if n > 1:
        lab[::ignore_every] = -100
    return lab


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 4096])
def test_gpu_logprobs_from_logits(n, dtype, strict):
    _cuda_or_skip()
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    tau = 0.8
    logits = _logits(n, V_REAL, dtype, seed=n).requires_grad_(True)
    labels = _labels(n, V_REAL, seed=n)
    logp, ent = mk.logprobs_from_logits(
        logits, labels, temperature=tau, return_entropy=True, backend="cuda"
    )
    g1 = torch.randn(n, device="cuda")
    g2 = torch.randn(n, device="cuda")
    (grad,) = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), logits)

    x64 = logits.detach().double().requires_grad_(True)
    lp64, ent64 = R.logprobs_from_logits_ref(x64, labels, temperature=tau, return_entropy=True)
    (grad64,) = torch.autograd.grad((lp64 * g1).sum() + (ent64 * g2).sum(), x64)
    xp = logits.detach().clone().requires_grad_(True)
    lpp, entp = R.logprobs_from_logits_ref(xp, labels, temperature=tau, return_entropy=True)
    (gradp,) = torch.autograd.grad((lpp * g1.to(dtype)).sum() + (entp * g2.to(dtype)).sum(), xp)

    assert logp.dtype == torch.float32 and grad.dtype == dtype
    assert_within_budget(logp, lp64, lpp, atol=2e-5, name="logp")
    assert_within_budget(ent, ent64, entp, atol=2e-5, name="entropy")
    assert_within_budget(grad, grad64, gradp, atol=1e-6, name="grad_logits")
    ignored = labels == -100
    assert torch.all(grad[ignored] == 0) and torch.all(logp[ignored] == 0)


@pytest.mark.gpu
def test_gpu_logprobs_gradient_through_logp_only(strict):
    # Entropy computed but unused: the backward gets no (or a zero) entropy gradient.
    _cuda_or_skip()
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    logits = _logits(7, V_REAL, torch.float32, seed=21).requires_grad_(True)
    labels = _labels(7, V_REAL, seed=21)
    logp, _ = mk.logprobs_from_logits(logits, labels, return_entropy=True, backend="cuda")
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    x64 = logits.detach().double().requires_grad_(True)
    (grad64,) = torch.autograd.grad(R.logprobs_from_logits_ref(x64, labels).sum(), x64)
    assert torch.allclose(grad.double(), grad64, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_logprobs_odd_vocab_and_misaligned_rows(dtype, strict):
    # V = 5003 makes rows start off 16-byte boundaries; the storage offset shifts row 0 too.
    _cuda_or_skip()
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    full = _logits(8, 5003, dtype, seed=3)
    logits = full[1:]  # contiguous, storage offset 5003 elements
    labels = _labels(7, 5003, seed=3)
    logp, ent = mk.logprobs_from_logits(logits, labels, return_entropy=True, backend="cuda")
    lp64, ent64 = R.logprobs_from_logits_ref(logits.double(), labels, return_entropy=True)
    lpp, entp = R.logprobs_from_logits_ref(logits, labels, return_entropy=True)
    assert_within_budget(logp, lp64, lpp, atol=2e-5, name="logp")
    assert_within_budget(ent, ent64, entp, atol=2e-5, name="entropy")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (4096, 1), (7, 3), (257, 3), (5, 6)])
def test_gpu_js_distance(n, k, dtype, strict):
    _cuda_or_skip()
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    p = _logits(n, V_REAL, dtype, seed=10 + n)

    def near(scale, seed):
        return (p.float() + scale * _logits(n, V_REAL, torch.float32, seed=seed)).to(dtype)

    streams = [
        lambda: p,  # identical: exactly 0
        lambda: near(0.05, 11 + n),
        lambda: _logits(n, V_REAL, dtype, seed=12 + n),
        lambda: near(1e-3, 13 + n),
        lambda: _logits(n, V_REAL, dtype, seed=14 + n, scale=1e3),
        lambda: p.flip(-1),
    ]
    q = torch.stack([make() for make in streams[:k]])
    d = mk.js_distance(p, q, temperature=1.3, backend="cuda")
    ref64 = R.js_distance_ref(p.double(), q.double(), temperature=1.3)
    plain = R.js_distance_ref(p, q, temperature=1.3)
    assert d.shape == (k, n) and d.dtype == torch.float32
    assert_within_budget(d, ref64, plain, atol=2e-5, name="js")
    assert torch.all(d[0] == 0), "identical rows must give exactly 0"
    assert torch.all((d >= 0) & (d <= 1))


@pytest.mark.gpu
def test_gpu_js_extreme_and_disjoint(strict):
    _cuda_or_skip()
    import mrtpo_kernels as mk

    v = V_REAL
    p = torch.full((4, v), -float("inf"), device="cuda")
    q = torch.full((4, v), -float("inf"), device="cuda")
    p[:, : v // 2] = 0.0
    q[:, v // 2 :] = 0.0  # disjoint supports
    d = mk.js_distance(p, q, backend="cuda")
    assert torch.allclose(d, torch.ones_like(d), atol=1e-6)
    big = torch.where(torch.rand(4, v, device="cuda") > 0.5, 1e4, -1e4)
    d2 = mk.js_distance(big, -big, backend="cuda")
    assert torch.isfinite(d2).all() and torch.allclose(d2, torch.ones_like(d2), atol=1e-5)
    same = torch.zeros(4, v, device="cuda")
    assert torch.all(mk.js_distance(same, same, backend="cuda") == 0)


@pytest.mark.gpu
def test_gpu_no_int32_overflow_beyond_2_to_31_elements(strict):
    # N x V = 16384 x 151936 = 2.49e9 > 2^31: rows at the end must be right.
    _cuda_or_skip()
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    n = 16384
    logits = torch.empty(n, V_REAL, device="cuda", dtype=torch.bfloat16)
    logits.normal_(0.0, 3.0)
    labels = torch.randint(0, V_REAL, (n,), device="cuda")
    logp = mk.logprobs_from_logits(logits, labels, backend="cuda")
    tail = slice(n - 3, n)
    ref = R.logprobs_from_logits_ref(logits[tail].double(), labels[tail])
    assert torch.allclose(logp[tail].double(), ref, atol=1e-4, rtol=1e-5)
    q = logits.clone()
    q[-1, -7:] = 20.0  # only the last row differs, at its last entries
    d = mk.js_distance(logits, q, backend="cuda")
    assert torch.all(d[:-1] == 0)
    ref_last = R.js_distance_ref(logits[-1:].double(), q[-1:].double())
    assert torch.allclose(d[-1:].double(), ref_last, atol=2e-5)
    del logits, q


@pytest.mark.gpu
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("clip", [None, (0.5, 2.0)])
@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_gpu_mrtpo_token_advantages(gamma, clip, scale_rewards, strict):
    _cuda_or_skip()
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    gen = torch.Generator().manual_seed(5)
    n_groups, g, k = 8, 8, 3
    n = n_groups * g
    rewards = torch.rand(n, k, generator=gen, dtype=torch.float64)
    group_ids = torch.arange(n_groups).repeat_interleave(g)
    lengths = torch.randint(1, 700, (n,), generator=gen)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rel = torch.rand(k, int(cu[-1]), generator=gen, dtype=torch.float64)
    rel[:, : int(cu[1])] = 0.0  # response 0: all-zero relevance -> uniform weights
    has_info = torch.rand(n, k, generator=gen) > 0.3
    out = mk.mrtpo_token_advantages(
        rewards.float().cuda(), group_ids.cuda(), rel.float().cuda(), has_info=has_info.cuda(),
        cu_seqlens=cu.cuda(), alpha=0.8, gamma=gamma, clip=clip, backend="cuda",
        scale_rewards=scale_rewards,
    )  # fmt: skip
    ref_tokens, _ = R.mrtpo_token_advantages_ref(
        rewards, group_ids, [rel[:, cu[i] : cu[i + 1]] for i in range(n)], has_info=has_info,
        alpha=0.8, gamma=gamma, clip=clip, scale_rewards=scale_rewards,
    )  # fmt: skip
    ref = torch.cat(ref_tokens)
    assert torch.allclose(out.token.double().cpu(), ref, atol=2e-5, rtol=2e-5)
    # Mass: sum over a response's tokens = T_i x its GDPO advantage.
    sums = torch.stack([out.token[cu[i] : cu[i + 1]].double().sum() for i in range(n)]).cpu()
    assert torch.allclose(sums, lengths * out.sequence.double().cpu(), atol=1e-3, rtol=1e-4)

"""Backend dispatch: auto choice, explicit choice, fallback with one warning, strict mode,
the float64 rule, the op table and the backends' declarations."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo_kernels import _catalog, _dispatch, backends
from mrtpo_kernels import reference as R

ROOT = Path(__file__).resolve().parents[1]


def test_auto_on_cpu_prefers_the_extension():
    expected = "cpu" if backends.load("cpu") is not None else "torch"
    assert mk.resolve_backend("linear_logprobs", "cpu") == expected
    assert mk.available_backends("linear_logprobs")[0] == expected


def test_env_override(monkeypatch):
    monkeypatch.setenv("MRTPO_BACKEND", "torch")
    assert mk.resolve_backend("linear_js_distance", "cpu") == "torch"
    monkeypatch.setenv("MRTPO_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="backend"):
        mk.resolve_backend("linear_js_distance", "cpu")


def test_unknown_op_names_the_argument():
    with pytest.raises(ValueError, match="op: expected one of"):
        mk.resolve_backend("linear_logprobs_fwd", "cpu")  # an entry point, not an op
    with pytest.raises(ValueError, match="op: expected one of"):
        mk.available_backends("nonsense")


def test_missing_op_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("MRTPO_STRICT_BACKEND", raising=False)
    cpu = backends.load("cpu")
    if cpu is None:
        pytest.skip("the C++ extension is not built")
    serves = {k: v for k, v in cpu.SERVES.items() if k != "js_distance"}
    monkeypatch.setattr(cpu, "SERVES", serves)  # a backend without one op
    _dispatch._warned.discard(("cpu", "js_distance"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = mk.resolve_backend("js_distance", "cpu", backend="cpu")
        b = mk.resolve_backend("js_distance", "cpu", backend="cpu")
    assert a == b == "torch"
    assert sum("cannot run js_distance" in str(w.message) for w in caught) == 1
    assert "cpu" not in mk.available_backends("js_distance")
    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "1")
    with pytest.raises(RuntimeError, match="MRTPO_STRICT_BACKEND"):
        mk.resolve_backend("js_distance", "cpu", backend="cpu")


def test_an_op_a_backend_lacks_runs_on_torch_with_one_warning(monkeypatch):
    # the cpu backend has no advantage kernel: auto picks torch silently, an explicit
    # backend="cpu" warns once (and raises in strict mode)
    monkeypatch.delenv("MRTPO_STRICT_BACKEND", raising=False)
    if backends.load("cpu") is None:
        pytest.skip("the C++ extension is not built")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mk.resolve_backend("mrtpo_token_advantages", "cpu") == "torch"
    _dispatch._warned.discard(("cpu", "mrtpo_token_advantages"))
    with pytest.warns(RuntimeWarning, match="cannot run mrtpo_token_advantages"):
        assert mk.resolve_backend("mrtpo_token_advantages", "cpu", backend="cpu") == "torch"
    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "1")
    with pytest.raises(RuntimeError, match="MRTPO_STRICT_BACKEND"):
        mk.resolve_backend("mrtpo_token_advantages", "cpu", backend="cpu")


def test_float64_goes_to_torch_where_a_backend_has_no_float64_kernel(monkeypatch):
    # the float64 contract, not a fallback: no warning, and no error in strict mode
    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "1")
    if backends.load("triton") is None:
        pytest.skip("triton is not installed")
    for op in ("linear_logprobs", "linear_js_distance", "linear_policy_loss"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mk.resolve_backend(op, "cuda", torch.float64, "triton") == "torch"
            assert mk.resolve_backend(op, "cuda", torch.float64) == "torch"
        assert mk.resolve_backend(op, "cuda", torch.bfloat16, "triton") == "triton"
        assert "triton" not in mk.available_backends(op, "cuda", torch.float64)
    # the advantage kernel computes in its input's dtype: float64 stays on triton
    assert mk.resolve_backend("mrtpo_token_advantages", "cuda", torch.float64) == "triton"


def test_device_bound_backends_reject_other_devices():
    with pytest.raises(ValueError, match="backend: 'cpu' needs CPU"):
        mk.resolve_backend("linear_logprobs", "cuda", backend="cpu")
    with pytest.raises(ValueError, match="backend: 'cuda' needs CUDA"):
        mk.resolve_backend("js_distance", "cpu", backend="cuda")


def test_op_table_covers_the_public_api():
    public = {name for name in mk.__all__ if callable(getattr(mk, name))}
    ops = set(mk.OPS)
    assert ops <= public
    assert ops == {n for n in public if not n[0].isupper()} - {
        "advantage_settings",
        "available_backends",
        "backend_status",
        "check_tensor",
        "resolve_backend",
    }
    for op in mk.OPS.values():
        assert callable(getattr(mk, op.name)), op.name
        assert callable(getattr(R, op.reference)), op.reference
        for test in op.tests:
            assert (ROOT / test).is_file(), test
        for where in op.kernels.values():
            for path in where.split(" + "):
                assert (ROOT / path).is_file(), path


def test_bench_workloads_exist():
    from bench.workloads import WORKLOADS

    named = {b for op in mk.OPS.values() for b in op.bench_workloads}
    assert named <= set(WORKLOADS)


def test_declarations_match_the_op_table():
    """A backend declares exactly the ops the table gives it a kernel for, and defines
    each of their entry points; the "torch" backend serves every op."""
    for name in backends.BACKENDS:
        mod = backends.load(name)
        if mod is None:
            continue
        table = {op.name for op in mk.OPS.values() if name in op.kernels}
        assert set(mod.SERVES) == table, name
        for op in table:
            for fn in mk.OPS[op].entry_points:
                assert callable(getattr(mod, fn, None)), f"{name}.{fn}"
    assert set(backends.load("torch").SERVES) == set(mk.OPS)


def test_backends_follow_the_contract():
    """The Protocols of backends/contract.py are the contract: the op table's entry points
    are those of each op's Protocol; every backend that loads is a ``Backend`` whose entry
    points take the Protocol's parameters (by count: the names are the backend's own);
    its ROW_KERNEL, where it has one, is a ``RowKernel`` whose ability flags say exactly
    which optional methods it defines."""
    import inspect

    from mrtpo_kernels.backends import contract

    for op in mk.OPS.values():
        want = contract.entry_point_names(contract.ENTRY_POINTS[op.name]) if op.entry_points else ()
        assert op.entry_points == want, op.name
    assert set(contract.ENTRY_POINTS) == {op.name for op in mk.OPS.values() if op.entry_points}
    optional = {"JS_MANY": ("js_many",), "GRAD_COLS": ("grad_cols_", "policy_terms")}
    loaded = 0
    for name in backends.BACKENDS:
        mod = backends.load(name)
        if mod is None:
            continue
        loaded += 1
        assert isinstance(mod, contract.Backend), name
        for op in mod.SERVES:
            proto = contract.ENTRY_POINTS.get(op)
            for fn in contract.entry_point_names(proto) if proto else ():
                want = list(inspect.signature(getattr(proto, fn)).parameters)[1:]
                got = list(inspect.signature(getattr(mod, fn)).parameters)
                assert len(got) == len(want), f"{name}.{fn}: {got} vs {want}"
        kern = mod.ROW_KERNEL
        if kern is None:
            continue
        assert isinstance(kern, contract.RowKernel), name
        for flag, methods in optional.items():
            for m in methods:
                own = getattr(type(kern), m, None)
                has = own is not None and own is not getattr(contract.RowKernel, m)
                assert getattr(kern, flag) == has, f"{name}: {flag} vs {m}"
        assert isinstance(kern.GRAD_OUT, bool) and isinstance(kern.NORM, bool)
    assert loaded >= 1


def _backends_page() -> str:
    """docs/backends.md as the site shows it: its generated sections filled from the code
    (tools/docs_pages.py, run by the docs build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_pages", ROOT / "tools" / "docs_pages.py")
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    return pages.fill((ROOT / "docs" / "backends.md").read_text())


def test_docs_show_the_op_table():
    assert _catalog.markdown() in _backends_page()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in a file (level 0 = absolute); ``from .. import x``
    gives (2, "x")."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.module:
                out.append((node.level, node.module))
            else:
                out.extend((node.level, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend((0, a.name) for a in node.names)
    return out


# import nothing from the package (checked below); any layer may use them
LEAVES = {"settings", "_types", "_token_terms"}


def test_leaves_import_nothing_from_the_package():
    for name in sorted(LEAVES):
        path = ROOT / "mrtpo_kernels" / f"{name}.py"
        for level, module in _imports(path):
            assert level == 0, f"{path.name} imports .{module}"
            assert not module.startswith(("mrtpo_kernels", "mrtpo", "bench")), (
                f"{path.name} imports {module}"
            )


@pytest.mark.parametrize("layer", ["triton_kernels", "backends"])
def test_lower_layers_import_nothing_above_them(layer):
    for path in sorted((ROOT / "mrtpo_kernels" / layer).glob("*.py")):
        for level, module in _imports(path):
            if level >= 2:  # from ..x import y: outside the layer
                top = module.split(".")[0]
                # backends may also use the Triton kernels and the compiled extensions
                allowed = LEAVES | (
                    {"triton_kernels", "_C", "_cuda"} if layer == "backends" else set()
                )
                assert top in allowed, f"{path.name} imports ..{module}"
            if level == 0:
                assert not module.startswith(("mrtpo_kernels", "mrtpo", "bench")), (
                    f"{path.name} imports {module}"
                )


def _lazy_attribute_hook(node) -> bool:
    """A module-level ``def __getattr__`` (PEP 562): Python calls it only for a name the loaded
    module lacks, so an import in its body runs after both modules exist."""
    return isinstance(node, ast.FunctionDef) and node.name == "__getattr__"


def _package_imports(packages=("mrtpo_kernels",)) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file, function-level
    imports included; not in a module-level ``__getattr__``), for every module of
    ``packages``."""
    mods = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for pkg in packages
        for p in (ROOT / pkg).rglob("*.py")
    }
    graph = {}
    for name, path in mods.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        tree.body = [n for n in tree.body if not _lazy_attribute_hook(n)]
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parent = base.rsplit(".", node.level - 1)[0] if node.level else ""
                mod = ".".join(x for x in (parent, node.module or "") if x)
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    out.add(sub if sub in mods else mod)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state:
                found = visit(t, path + [t])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_package_import_graph_has_no_cycle():
    """No module of mrtpo_kernels imports (at module or call level) a module that imports
    it back, directly or through others; the package's __init__, which gathers the public
    names (and is where ``from .. import _C`` resolves), is left out as a target."""
    graph = {m: ts - {"mrtpo_kernels"} for m, ts in _package_imports().items()}
    cycle = _first_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert len(graph) > 20 and graph["mrtpo_kernels.logprobs"]


def test_the_project_import_graph_has_no_cycle():
    """The same over the whole project (mrtpo_kernels, mrtpo, bench): every import one-way.
    The TRL trainer's module imports the functions' module (``mrtpo.integrations.trl``),
    never the reverse; tests/test_integrations_trl.py checks that the functions' module
    imports without TRL."""
    graph = {
        m: ts - {"mrtpo_kernels"}
        for m, ts in _package_imports(("mrtpo_kernels", "mrtpo", "bench")).items()
    }
    cycle = _first_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the graph reaches across the packages and sees call-level imports
    assert "mrtpo.model.pretrained" in graph["mrtpo.model.loading"]  # inside load_model
    assert "bench.cost_plans" in graph["bench.cost_model_cpu"]
    assert "mrtpo.integrations.trl" in graph["mrtpo.integrations.trl_grpo.trainer"]


def test_the_cycle_finder_finds_a_cycle():
    assert _first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _first_cycle({"a": {"b"}, "b": set()}) is None


# The modules of mrtpo_kernels that its docstring names public; everything else in the
# package (backends, triton_kernels, the _-prefixed modules, the compiled _C / _cuda) is
# internal, and bench uses only these and the names of ``mrtpo_kernels.__all__``.
PUBLIC_MODULES = {"reference", "settings", "chunk_plan"}


def _private_uses(source: str) -> list[str]:
    """What ``source`` (a bench file) reaches of mrtpo_kernels outside its public API: an
    import of an internal module (``import mrtpo_kernels.backends``, ``from
    mrtpo_kernels.triton_kernels import rows``), a name from the package that is neither in
    ``__all__`` nor a public module (``from mrtpo_kernels import backends, _C``), an
    internal module by name (``importlib.import_module("mrtpo_kernels._cuda")``), or an
    attribute of the package that is not public (``mk._dispatch``, ``mk.backends``)."""
    public = set(mk.__all__) | PUBLIC_MODULES | {"__version__"}
    found = []

    def module_ok(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] != "mrtpo_kernels" or len(parts) == 1 or parts[1] in PUBLIC_MODULES

    aliases = set()  # local names bound to the package itself
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not module_ok(a.name):
                    found.append(f"import {a.name}")
                if a.name == "mrtpo_kernels":
                    aliases.add(a.asname or a.name)
                elif a.name.startswith("mrtpo_kernels.") and a.asname is None:
                    aliases.add("mrtpo_kernels")  # import a.b binds a
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not module_ok(node.module):
                found.append(f"from {node.module} import ...")
            elif node.module == "mrtpo_kernels":
                bad = [a.name for a in node.names if a.name not in public]
                found += [f"from mrtpo_kernels import {name}" for name in bad]
        elif isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func)
            first = node.args[0]
            if name.endswith(("import_module", "__import__")) and isinstance(first, ast.Constant):
                if isinstance(first.value, str) and not module_ok(first.value):
                    found.append(f"{name}({first.value!r})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases and node.attr not in public:
                found.append(f"{node.value.id}.{node.attr}")
    return found


def test_bench_uses_the_public_api_only():
    """No bench file reaches an internal module of mrtpo_kernels (bench measures what users
    call; where it needs more, the package gets a public, documented entry point)."""
    doc = mk.__doc__.split("Public modules:")[1]
    for name in PUBLIC_MODULES:  # the allowed modules are the ones the docstring names
        assert f"``mrtpo_kernels.{name}``" in doc, name
    paths = sorted((ROOT / "bench").rglob("*.py"))
    assert len(paths) > 20
    for path in paths:
        found = _private_uses(path.read_text())
        assert not found, f"{path.relative_to(ROOT)} uses internals: {found}"


@pytest.mark.parametrize(
    "source",
    [
        "from mrtpo_kernels import backends",
        "from mrtpo_kernels import chunk_plan, _C",
        "import mrtpo_kernels.backends.cpu_backend",
        "import mrtpo_kernels._cuda as cu",
        "from mrtpo_kernels.triton_kernels import rows",
        "from mrtpo_kernels.backends._chunked import balanced",
        "from mrtpo_kernels._dispatch import available",
        "import importlib\nimportlib.import_module('mrtpo_kernels.backends')",
        "__import__('mrtpo_kernels._C')",
        "import mrtpo_kernels as mk\nmk._dispatch.available('x', 'cpu', None)",
        "def f():\n    import mrtpo_kernels\n    return mrtpo_kernels.backends.load('cpu')",
        "import mrtpo_kernels.reference\nmrtpo_kernels._catalog.OPS",
    ],
)
def test_the_bench_check_finds_internal_uses(source):
    assert _private_uses(source), source


def test_the_bench_check_passes_the_public_api():
    source = (
        "import mrtpo_kernels as mk\n"
        "from mrtpo_kernels import chunk_plan, linear_js_distance, reference as ref\n"
        "from mrtpo_kernels.reference import js_distance_ref\n"
        "import mrtpo_kernels.settings\n"
        "mk.linear_logprobs, mk.backend_status(), mk.PolicyLossSettings, mk.OPS\n"
    )
    assert _private_uses(source) == []


def test_settings_reject_non_numbers(monkeypatch):
    from mrtpo_kernels import settings

    for name in ("MRTPO_CHUNK_BYTES", "MRTPO_JS_SCRATCH_BYTES"):
        monkeypatch.setenv(name, "lots")
        with pytest.raises(ValueError, match=name):
            settings.positive_int(name)
    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "maybe")
    with pytest.raises(ValueError, match="MRTPO_STRICT_BACKEND"):
        settings.strict_backend()
    for bad in ("2048", "3000,8", "2048,3", "8,4", "a,b"):
        monkeypatch.setenv("MRTPO_ROW_BLOCK", bad)
        with pytest.raises(ValueError, match="MRTPO_ROW_BLOCK"):
            settings.row_block()
    monkeypatch.setenv("MRTPO_OVERLAP_ROWS", "sometimes")
    with pytest.raises(ValueError, match="MRTPO_OVERLAP_ROWS"):
        settings.overlap_rows()
    monkeypatch.delenv("MRTPO_OVERLAP_ROWS")
    assert settings.overlap_rows() is False
    monkeypatch.setenv("MRTPO_ROW_BLOCK", "4096, 16")
    assert settings.row_block() == (4096, 16)
    monkeypatch.delenv("MRTPO_ROW_BLOCK")
    assert settings.row_block() is None
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", "lots")
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 4, generator=g), torch.randn(7, 4, generator=g)
    with pytest.raises(ValueError, match="MRTPO_CHUNK_BYTES"):
        mk.linear_logprobs(h, w, torch.zeros(3, dtype=torch.long), backend="torch")


def test_docs_list_every_setting():
    from mrtpo_kernels import settings

    page = _backends_page()
    for name, s in settings.SETTINGS.items():
        assert f"| `{name}` |" in page, name
        assert " ".join(s.meaning.split())[:60] in page, name


def test_nothing_reads_mrtpo_variables_outside_settings():
    for path in sorted((ROOT / "mrtpo_kernels").rglob("*.py")):
        if path.name == "settings.py":
            continue
        assert "MRTPO_" not in "".join(
            line for line in path.read_text().splitlines() if "environ" in line
        ), path


def test_backends_agree():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 8, generator=g), torch.randn(300, 8, generator=g)
    y = torch.randint(0, 300, (9,), generator=g)
    outs = {}
    for name in ("cpu", "torch"):
        if backends.load(name) is not None:
            outs[name] = mk.linear_logprobs(h, w, y, return_entropy=True, backend=name)
    ref = outs["torch"]
    for name, out in outs.items():
        assert torch.allclose(out[0], ref[0], atol=1e-5), name
        assert torch.allclose(out[1], ref[1], atol=1e-5), name


def test_compile_fullgraph_traces_the_public_api():
    # The ops are torch.library custom ops with fake kernels and the backend choice is a
    # trace-time constant: dynamo traces a caller of the public API without graph breaks
    # (eager backend: no C++ compiler needed for this check).
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(6, 4, generator=g), torch.randn(50, 4, generator=g)
    y = torch.randint(0, 50, (6,), generator=g)

    def step(h, w):
        lp, ent = mk.linear_logprobs(h, w, y, return_entropy=True)
        d = mk.linear_js_distance(h, (h + 0.1)[None], w)
        loss, _ = mk.linear_policy_loss(h, w, y, lp.detach(), torch.ones(6))
        return lp.sum() + ent.sum() + d.sum() + loss

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(h, w), step(h, w))


def test_missing_extension_warns_once_then_runs_on_torch(monkeypatch):
    monkeypatch.delenv("MRTPO_STRICT_BACKEND", raising=False)
    monkeypatch.setitem(backends._errors, "cpu", "ImportError: pretend the build failed")
    monkeypatch.delitem(backends._loaded, "cpu", raising=False)
    _dispatch._warned.discard(("cpu", "any op"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = {mk.resolve_backend(op, "cpu") for op in ("linear_js_distance", "linear_logprobs")}
    assert names == {"torch"}
    assert sum("pretend the build failed" in str(w.message) for w in caught) == 1

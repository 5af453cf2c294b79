# Two commands do all the set-up on a fresh machine:
#   make run   - create .venv, install pinned dependencies, build the extension, run the main job
#   make test  - the same set-up when needed, then the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.ext-built
CSRC := $(wildcard csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.cpp csrc/cuda/*.h)
export OMP_NUM_THREADS ?= 2

.PHONY: setup build run test test-fast test-triton test-install test-frameworks lint bench gpu-check clean docs

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements.txt requirements-real.txt requirements-engines.txt pyproject.toml | $(PY)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-real.txt
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-deps --no-build-isolation -r requirements-engines.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(BUILT): $(DEPS) setup.py $(CSRC)
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) setup.py -q build_ext --inplace
	touch $@

setup: $(BUILT)
build: $(BUILT)

run: $(BUILT)
	$(PY) -m mrtpo train --task constraints --algo mrtpo --steps 40 --device cpu --threads 1 --out runs/train --overwrite

test: $(BUILT)
	$(PY) -m pytest -q -ra

test-fast: $(BUILT)
	$(PY) -m pytest -q -x -m "not slow and not gpu"

# the Triton kernels under TRITON_INTERPRET=1 (marker triton; make test runs them too)
test-triton: $(BUILT)
	$(PY) -m pytest -q -ra -m "triton and not gpu"

# the README's install block as written, in a bare venv on a copy of the checkout (minutes:
# the C++ build and some 70 packages; make test skips it)
test-install: $(DEPS)
	MRTPO_TEST_INSTALL=1 $(PY) -m pytest -q -ra tests/test_install.py

# verl and OpenRLHF pin other transformers versions than the project: their tests run in a
# venv of their own (docs/integrations.md, "Tested inside the frameworks").
FVENV ?= .venv-frameworks
FPY := $(FVENV)/bin/python
FDEPS := $(FVENV)/.deps-installed
FREQ := tests/frameworks/requirements.txt

$(FDEPS): $(FREQ)
	test -x $(FPY) || $(PYTHON) -m venv $(FVENV)
	$(FPY) -m pip install -q --no-deps $$(grep -E '^(torch|numpy)==' $(FREQ)) setuptools==84.2.1
	$(FPY) -m pip install -q --no-deps --no-build-isolation -r $(FREQ)
	touch $@

test-frameworks: $(FDEPS)
	PYTHONPATH=. $(FPY) -m pytest -q -ra -o addopts= -p no:cacheprovider -W ignore::UserWarning \
		-W ignore::FutureWarning -W ignore::DeprecationWarning tests/frameworks

# the documentation site (mkdocs.yml), a strict build into site/ (every link and reference
# must resolve; generated pages are computed from the code). It needs the docs tools and the
# package's import surface only (torch, numpy: tools/docs_pages.py imports mrtpo_kernels and
# mrtpo.training.config from the checkout), not the development build: .venv where `make setup`
# made it, else a venv of its own. requirements-docs.txt pins every package the tools pull in, so it
# installs with --no-deps: pip then checks nothing else in the venv (in .venv, the [real]
# wheels installed --no-deps would fail that check: a resolver ERROR block about bfcl-eval).
DVENV ?= $(if $(wildcard $(DEPS)),$(VENV),.venv-docs)
DPY := $(DVENV)/bin/python
DOCDEPS := $(DVENV)/.docs-installed

$(DOCDEPS): requirements-docs.txt
	test -x $(DPY) || $(PYTHON) -m venv $(DVENV)
	$(DPY) -m pip install -q $$(grep -E '^(torch|numpy)==' requirements.txt)
	$(DPY) -m pip install -q --no-deps -r requirements-docs.txt
	touch $@

docs: $(DOCDEPS)
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(DPY) -m mkdocs build --strict --site-dir site

lint: $(DEPS)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@if command -v clang-format >/dev/null; then clang-format --dry-run --Werror csrc/*/*; \
	else echo "clang-format not installed: skipped"; fi

bench: $(BUILT)
	$(PY) -m bench

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf build *.egg-info mrtpo_kernels/*.so $(BUILT)

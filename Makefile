# sdpa: the package and the book. `make` alone lists the targets.
# Every target sets up .venv first if it is missing or out of date.

PYTHON      ?= python3
NPM         ?= npm
VENV        ?= .venv
BUILDDIR    ?= _build
SPHINXOPTS  ?= -n -W --keep-going
PYTEST_ARGS ?=
HOST        ?= 127.0.0.1
PORT        ?= 8000
EXTRAS      ?= test,docs
# The benchmark compares with PyTorch at this exact pin (any other spec downloads GBs of CUDA).
TORCH       ?= torch==2.13.0
BENCH_OUT   ?= $(BUILDDIR)/bench
BENCH_ARGS  ?=
REFRESH     ?=

VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# MathJax (pinned in package.json / package-lock.json) is installed with `npm ci`; it typesets
# the book's maths under Node when the site is built (book/_ext/sdpa_mathjax.py).
NODE_STAMP := node_modules/.package-lock.json
# One doctree folder for the html and doctest builders; it also holds the execution cache
# (doctrees/jupyter-cache/<fingerprint of src/sdpa>), so a package change re-executes the book.
SPHINX := $(VPY) -m sphinx -c . book -d $(BUILDDIR)/doctrees
# The sdpa wheel and source archive the site offers (book/_ext/sdpa_downloads.py copies them into
# _build/html/downloads/ with the notebooks). The wheel holds the packages of src/; the source
# archive (the sdist, MANIFEST.in) the whole project, so that `make html` and `make test` work in
# an unpacked copy, which has no .git. Rebuilt only when a file that goes into them changes.
DIST       := $(BUILDDIR)/dist
DIST_STAMP := $(DIST)/.built
DIST_ROOT  := Makefile MANIFEST.in conf.py pyproject.toml README.md CONTRIBUTING.md LICENSE \
              constraints.txt package.json package-lock.json .gitignore
DIST_DEPS  := $(DIST_ROOT) $(shell find .ci benchmarks book src tests -type f \
                -not -path '*/__pycache__/*' -not -path '*/.ipynb_checkpoints/*' \
                -not -name '*.py[cod]' -not -name '*.tmp' 2>/dev/null)

.DEFAULT_GOAL := help
.PHONY: help venv node_modules test unit lint doctest html html-force serve bench demo constraints clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

venv: $(STAMP) ## create .venv and install sdpa (editable) with its test and docs extras

$(NODE_STAMP): package.json package-lock.json
	$(NPM) ci --no-audit --no-fund --ignore-scripts
	touch $@

node_modules: $(NODE_STAMP) ## install MathJax for the book from package-lock.json (npm ci)

# The reader's tests rebuild the book from the source archive in a fresh folder, and run every
# page's notebook in a fresh environment (minutes of page execution, mostly one core): they run
# beside the other tests, their output shown when both are done; either failing fails the run.
# (Three streams, one per reader test, were slower on two cores than two.) The widgets' browser
# test joins them: the other stream, with the crawl of every page, was the longer by 150 s.
BESIDE_TESTS := tests/book/test_source_archive.py tests/book/test_notebooks.py tests/book/test_site_widgets.py
test: $(STAMP) lint html-force ## run every test: lint, unit, doctests, README, book build and browser
	@$(VPY) -m pytest -p no:cacheprovider $(BESIDE_TESTS) $(PYTEST_ARGS) > $(BUILDDIR)/beside-tests.log 2>&1 & beside=$$!; \
	$(VPY) -m pytest $(foreach t,$(BESIDE_TESTS),--ignore=$(t)) $(PYTEST_ARGS); status=$$?; \
	wait $$beside || status=1; \
	echo "== $(BESIDE_TESTS) (run beside the others) =="; cat $(BUILDDIR)/beside-tests.log; \
	exit $$status

unit: $(STAMP) ## run the unit tests and doctests only (no book build, no browser)
	$(VPY) -m pytest -m "not browser and not site" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff check, ruff format --check, and numpydoc's validation of the public API
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(VPY) -m pytest -q -p no:cacheprovider tests/test_docstrings.py

doctest: $(STAMP) ## run the doctests of the package, the README and the book
	$(VPY) -m pytest src/sdpa README.md $(PYTEST_ARGS)
	$(SPHINX) -b doctest $(BUILDDIR)/doctest $(SPHINXOPTS) -q

$(DIST_STAMP): $(STAMP) $(DIST_DEPS)
	rm -rf $(DIST)
	$(VPY) -m build --quiet --outdir $(DIST) .
	touch $@

# Both builds read (and execute) the pages in JOBS processes: two kernels at once on two cores.
# A rebuild with nothing to execute is no slower for it.
JOBS ?= -j 2
html: $(STAMP) $(NODE_STAMP) $(DIST_STAMP) ## build the book into _build/html, with its notebooks and the sdpa wheel (re-runs pages whose code or src/ changed)
	$(SPHINX) -b html $(BUILDDIR)/html $(SPHINXOPTS) $(JOBS)

# Forced execution: the execution cache is emptied and every page re-read, so every page runs
# afresh; the fresh outputs refill the cache, so a following `make html` has nothing to redo.
html-force: $(STAMP) $(NODE_STAMP) $(DIST_STAMP) ## build the book, executing every page afresh
	rm -rf $(BUILDDIR)/doctrees/jupyter-cache
	$(SPHINX) -b html $(BUILDDIR)/html $(SPHINXOPTS) -E $(JOBS)

serve: ## serve the built book on http://127.0.0.1:8000 (search does not work from file://)
	@test -f $(BUILDDIR)/html/index.html || { echo "no book in $(BUILDDIR)/html: run 'make html' first"; exit 1; }
	@# One clear line instead of http.server's traceback when the port is taken.
	@err=$$($(PYTHON) -c "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('$(HOST)', int('$(PORT)')))" 2>&1) \
	  || { echo "cannot serve on http://$(HOST):$(PORT)/ ($$(echo "$$err" | tail -n 1)): is the book already served? Choose another port: make serve PORT=8001"; exit 1; }
	@echo "Serving the book at http://$(HOST):$(PORT)/ (Ctrl-C stops)"
	$(PYTHON) -m http.server $(PORT) --bind $(HOST) --directory $(BUILDDIR)/html

# PyTorch is installed (at the pin) only when missing or at another version. Results go to the
# untracked $(BENCH_OUT)/; REFRESH=1 writes benchmarks/results/ instead, which is tracked.
bench: $(STAMP) ## benchmark against PyTorch into _build/bench/ (REFRESH=1: benchmarks/results/)
	@$(VPY) -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$(patsubst torch==%,%,$(TORCH))')" 2>/dev/null \
	  || { echo "installing $(TORCH) for the comparison"; $(VPY) -m pip install --quiet "$(TORCH)"; }
	$(VPY) benchmarks/run.py $(if $(REFRESH),--refresh,--out $(BENCH_OUT)) $(BENCH_ARGS)

demo: $(STAMP) ## run the demonstration, python -m sdpa
	$(VPY) -m sdpa

constraints: $(STAMP) ## refresh constraints.txt from the working .venv
	$(VPY) -m pip freeze --exclude-editable | grep -v '^torch==' > constraints.txt

clean: ## remove build outputs and the execution cache (keeps .venv and node_modules)
	rm -rf $(BUILDDIR) .pytest_cache .hypothesis

# sdpa: the package and the book. `make` alone lists the targets.
# Every target sets up .venv first if it is missing or out of date.

PYTHON      ?= python3
VENV        ?= .venv
BUILDDIR    ?= _build
SPHINXOPTS  ?= -n -W --keep-going
PYTEST_ARGS ?=
HOST        ?= 127.0.0.1
PORT        ?= 8000
EXTRAS      ?= test,docs,bench

VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SPHINX := $(VPY) -m sphinx -c . book $(BUILDDIR)/html $(SPHINXOPTS)

.DEFAULT_GOAL := help
.PHONY: help venv test unit doctest html html-force serve bench demo constraints clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

venv: $(STAMP) ## create .venv and install sdpa (editable) with its test, docs and bench extras

test: $(STAMP) html-force ## run every test: unit, doctests, README, book build and browser
	$(VPY) -m pytest $(PYTEST_ARGS)

unit: $(STAMP) ## run the unit tests and doctests only (no book build, no browser)
	$(VPY) -m pytest -m "not browser" $(PYTEST_ARGS)

doctest: $(STAMP) ## run the doctests of the package, the README and the book
	$(VPY) -m pytest src/sdpa README.md $(PYTEST_ARGS)
	$(VPY) -m sphinx -b doctest -c . book $(BUILDDIR)/doctest $(SPHINXOPTS) -q

html: $(STAMP) ## build the book into _build/html (re-executes pages whose inputs changed)
	$(SPHINX)

html-force: $(STAMP) ## build the book, executing every page afresh
	$(SPHINX) -E -D nb_execution_mode=force

serve: ## serve the built book on http://127.0.0.1:8000 (site search needs http)
	@test -d $(BUILDDIR)/html || { echo "run 'make html' first"; exit 1; }
	$(PYTHON) -m http.server $(PORT) --bind $(HOST) --directory $(BUILDDIR)/html

bench: $(STAMP) ## run the benchmarks and write benchmarks/results/
	$(VPY) benchmarks/run.py

demo: $(STAMP) ## run the demonstration, python -m sdpa
	$(VPY) -m sdpa

constraints: $(STAMP) ## refresh constraints.txt from the working .venv
	$(VPY) -m pip freeze --exclude-editable | grep -v '^torch==' > constraints.txt

clean: ## remove build outputs (keeps .venv)
	rm -rf $(BUILDDIR) .pytest_cache .hypothesis

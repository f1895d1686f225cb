# moelab: `make help` lists the targets.
#
# By default every target runs in .venv (created and kept in sync with pyproject.toml by
# `make setup`). On a machine that already has the stack (the GPU machine), point PYTHON at
# its interpreter and setup is skipped:  make train PRESET=gpu-small PYTHON=python3

PYTHON ?= .venv/bin/python
VENV := .venv
BOOTSTRAP_PYTHON ?= python3
EXTRAS ?= lab,dev
# Installed before moelab on machines without an NVIDIA driver, so pip keeps this CPU build
# instead of resolving torch to a multi-GB CUDA build. Elsewhere, add e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu to fetch the CPU build from PyTorch's index.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PRESET ?=
RUNS ?=
SHARD ?=
JOBS ?=
PROBE ?=
PORT ?= 5000
ARGS ?=
STAMP := $(VENV)/.moelab-setup

ifeq ($(PYTHON),$(VENV)/bin/python)
SETUP := setup
else
SETUP :=
endif

.DEFAULT_GOAL := help
.PHONY: help setup test test-fast mutate lint data train info study-1 study-2 study-3 study-4 induction-probe throughput bench kda-check kda-bench kda-aot model-bench ddp-check mlflow-ui lab sync-nbs

help: ## list the targets
	@echo "usage: make TARGET [PRESET=...] [RUNS=arm:seed,...] [PYTHON=python3] [ARGS='--set key=value ...']"
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_% -]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## create .venv and install moelab (editable, with the lab and dev extras: EXTRAS=lab,dev); no-op while pyproject.toml is unchanged
	@set -e; hash=$$(sha256sum pyproject.toml | cut -c1-16); \
	if [ -f $(STAMP) ] && [ "$$(cat $(STAMP))" = "$$hash" ] && [ -x $(VENV)/bin/python ]; then \
		echo "setup: $(VENV) is up to date with pyproject.toml"; exit 0; fi; \
	[ -x $(VENV)/bin/python ] || $(BOOTSTRAP_PYTHON) -m venv $(VENV); \
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(VENV)/bin/python -c "import torch" 2>/dev/null; then \
		echo "setup: no NVIDIA driver: installing the CPU build ($(TORCH_SPEC))"; \
		$(VENV)/bin/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"; fi; \
	$(VENV)/bin/python -m pip install -e ".[$(EXTRAS)]"; \
	echo $$hash > $(STAMP); echo "setup: done ($(VENV))"

# Tests run one intra-op thread per process unless OMP_NUM_THREADS says otherwise: their tensors
# are small, and on a 2-core machine that is busy with anything else two threads keep waiting on
# each other (measured on a shared 2-core machine: the whole suite in 8 min with 2 threads, 2 min with 1).
TEST_ENV := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}
# Training and studies too: on a busy machine the default thread count spins against the other processes
# (issue 38: study 1's cpu preset many times slower); OMP_NUM_THREADS=N make ... gives more.
RUN_ENV := $(TEST_ENV)
# ... and one such process per core (pytest-xdist, `-n auto`): the 2-core CI machine ran the suite in 36 min
# as one process and in 19 min as two (6bc93f0). TEST_WORKERS=0: one process; an interpreter without
# pytest-xdist (e.g. PYTHON=python3 on a GPU machine) runs one process too.
TEST_WORKERS ?= auto
TEST_XDIST = $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS)")

test: $(SETUP) ## install if needed, then run the whole test suite, one process per core (what CI runs; TEST_WORKERS=0: one process)
	@rc=0; $(TEST_ENV) $(PYTHON) -m pytest -q $(TEST_XDIST) $(ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; exit $$rc

test-fast: $(SETUP) ## the test suite without tests marked slow
	$(TEST_ENV) $(PYTHON) -m pytest -q $(TEST_XDIST) -m "not slow" $(ARGS)

# Not part of `make test`: each mutation reruns its test files in a scratch copy of the repository.
mutate: $(SETUP) ## mutation check: every curated bug in tests/mutation/mutations.py must fail its tests (ARGS=NAME ... for some)
	$(TEST_ENV) $(PYTHON) -m tests.mutation.mutate $(ARGS)

lint: $(SETUP) ## ruff
	$(PYTHON) -m ruff check moelab tests nbs kernels

data: $(SETUP) ## prepare the corpus of PRESET (default cpu): tokenizer + verified token cache under data/cache
	$(PYTHON) -m moelab data --config $(or $(PRESET),cpu) $(ARGS)

train: $(SETUP) ## train PRESET (default cpu); ARGS="--set train.max_steps=100 --resume"
	$(RUN_ENV) $(PYTHON) -m moelab train --config $(or $(PRESET),cpu) $(ARGS)

info: $(SETUP) ## parameter counts and FLOPs of PRESET (default k3)
	$(PYTHON) -m moelab info --config $(or $(PRESET),k3) $(ARGS)

study-1 study-2 study-3 study-4: study-%: $(SETUP) ## study-N: run study N's notebook (PRESET=research|gpu: the report in studies/NN_name/; cpu: runs/studies/NN_name/); RUNS=arm:seed,... or SHARD=i/n: a split call (JOBS=k: k at once on one GPU; PROBE=n: time its runs, n steps each, no record)
	$(RUN_ENV) $(PYTHON) -m moelab study $* $(if $(PRESET),--preset $(PRESET)) $(if $(RUNS),--runs $(RUNS)) $(if $(SHARD),--shard $(SHARD)) $(if $(JOBS),--jobs $(JOBS)) $(if $(PROBE),--probe $(PROBE)) $(ARGS)

induction-probe: $(SETUP) ## study 4's toy CPU probe: steps to learn in-context copying, rotary / NoPE attention vs the KDA + NoPE-MLA hybrid (~25 min on 2 cores) -> studies/04_context_curriculum/results/induction_cpu.json
	$(PYTHON) -m moelab.studies.induction --out studies/04_context_curriculum/results/induction_cpu.json $(ARGS)

throughput: $(SETUP) ## train PRESET (default gpu-small) and record tokens/s + MFU in kernels/results/model_h200.json
	$(PYTHON) -m moelab train --config $(or $(PRESET),gpu-small) --throughput kernels/results/model_h200.json $(ARGS)

ENTRY ?=
bench: $(SETUP) ## GPU: one benchmark entry (ENTRY=kda|kda_long|kda_infer|attnres|moe|conv|model; ARGS='--shapes ... --base REV --rounds N'; `$(PYTHON) kernels/bench.py --list`) -> kernels/results/<entry>_<gpu>.json
	@[ -n "$(ENTRY)" ] || { echo "make bench: ENTRY=NAME is required; the entries:" >&2; $(PYTHON) kernels/bench.py --list >&2; exit 2; }
	$(PYTHON) kernels/bench.py --entry $(ENTRY) $(ARGS)

# Job execution (GenAI evaluation workers, ~8 processes) is off unless you set it: browsing runs needs none.
kda-check: $(SETUP) ## GPU: bf16 correctness of the Triton KDA op vs the fp32 recurrence, gate gradients beside fla's -> kernels/results/kda_check_h200.json; ARGS='--commit SHA --part gate'
	$(PYTHON) kernels/check_kda_gpu.py --out kernels/results/kda_check_h200.json $(ARGS)

kda-bench: $(SETUP) ## GPU: make bench ENTRY=kda, then ENTRY=kda_long (KDA op speed/memory, moelab vs fla vs SDPA)
	$(PYTHON) kernels/bench.py --entry kda $(ARGS)
	$(PYTHON) kernels/bench.py --entry kda_long $(ARGS)

kda-aot: $(SETUP) ## any machine: compile the KDA kernels for sm_90 and print registers / spills (ARGS='--infer --maxnreg 168': the inference forward's kernels, uncapped and capped; '--conv': the ShortConv kernels)
	$(PYTHON) kernels/aot_kda.py $(ARGS)

model-bench: $(SETUP) ## GPU: make bench ENTRY=model (ARGS='--shapes k3-mini --rounds 8 --budget-s 280'; TRITON_CACHE_DIR=$PWD/.tcache keeps compiled kernels)
	$(PYTHON) kernels/bench.py --entry model $(ARGS)

ddp-check: $(SETUP) ## 2 GPUs: two DDP ranks train k3-mini (quantile balancing) 100 steps, biases and weights must end bitwise equal -> kernels/results/ddp_check_h200.json; ARGS='--commit SHA'
	$(PYTHON) kernels/check_ddp.py --out kernels/results/ddp_check_h200.json $(ARGS)

mlflow-ui: $(SETUP) ## serve the MLflow dashboard of ./mlflow.db on http://127.0.0.1:PORT (default 5000; pick "Model training")
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} \
	$(PYTHON) -m mlflow server --host 127.0.0.1 --port $(PORT) --backend-store-uri sqlite:///$(CURDIR)/mlflow.db

# JupyterLab refuses to start as root without --allow-root: the usual user in containers and on GPU machines.
LAB_ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# PORT's default (5000) is the dashboard's; the lab takes 8888 unless PORT is given.
LAB_PORT = $(if $(filter file,$(origin PORT)),8888,$(PORT))

lab: $(SETUP) ## start JupyterLab on the notebooks on http://127.0.0.1:PORT (default 8888); ARGS go to jupyter lab
	$(PYTHON) -m jupyterlab --ip 127.0.0.1 --port $(LAB_PORT) --no-browser $(LAB_ALLOW_ROOT) --notebook-dir $(CURDIR) $(ARGS)

sync-nbs: $(SETUP) ## re-pair nbs/NN_name.py and nbs/NN_name.ipynb after editing either
	$(PYTHON) -m jupytext --sync nbs/[0-9][0-9]_*.py

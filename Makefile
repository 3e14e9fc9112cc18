# Ferry: `make serve` and `make test` each create (or reuse) .venv and install what they need.
#
# torch's version is pinned in constraints.txt, which the image installs from too. TORCH_INDEX picks
# the build: by default the CPU build that CI and the developers' machines carry on local disk; on a
# GPU machine the CUDA build of the same version:
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cu130 MODEL=/models/qwen3-30b-a3b
PYTHON      ?= python3
VENV        ?= .venv
TORCH_INDEX ?=
MODEL       ?=
SERVE_ARGS  ?=
PYTEST_ARGS ?=
# pytest-xdist workers: one more than CI's 2 cores, as a third of a worker's time is spent waiting on served
# processes and sockets (two workers kept the cores two-thirds busy, three keep them busy)
TEST_WORKERS ?= 3

BIN   := $(VENV)/bin
STAMP := $(VENV)/.ferry-installed

.PHONY: venv serve test lint-tools image clean gpu-check gpu-check-multi

venv: $(STAMP)

# the host expert kernel's C sources too: `pip install -e .` compiles them in place, so a change needs a reinstall;
# pip writes the bytecode at install, once: left to the first imports, the suite's processes starting side by side
# each compiled torch's and transformers' modules again (a fresh clone's suite took 16 min 39 s so, 13 min 10 s not)
$(STAMP): pyproject.toml Makefile constraints.txt $(wildcard kernels/host_experts_c/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/ferry serve $(MODEL) $(SERVE_ARGS)

# dclint (compose.yaml's linter) runs through npx; fetching it once puts it in the npm cache, after which
# the suite runs it with --offline.
DCLINT := dclint@3.1.0

lint-tools:
	@command -v npx >/dev/null || { echo "make: npx not found: install node and npm (dclint lints compose.yaml)" >&2; exit 1; }
	npx --yes $(DCLINT) --version >/dev/null

# --dist loadfile: each file's tests run on one worker, which builds the file's module-scoped fixtures (served
# clusters, interpreted kernel runs) once; files go out in collection order, the slow ones first (tests/conftest.py)
test: $(STAMP) lint-tools
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The GPU release check (tools/gpu_check.py): the CUDA tests, then `ferry serve` with the Qwen3-30B-A3B
# config and the openai client. Run it on a CUDA host, from this tree, with a CUDA torch installed
# (e.g. `make venv TORCH_INDEX=https://download.pytorch.org/whl/cu130`); results land in $(OUT)/gpu_check.json.
OUT        ?= out
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

GPU_CHECK_ARGS ?=

gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)

# The same on a host of two GPUs or more, for expert parallelism: the two-rank CUDA tests, then
# `ferry serve --expert-parallel-size 2` with the openai client
gpu-check-multi:
	$(GPU_PYTHON) tools/gpu_check.py --out $(OUT) --tests tests/gpu_multi --workers 1 \
	  --serve-args "--load-format dummy --gpu-memory 24GiB --expert-parallel-size 2"

# TORCH_INDEX, when set, picks the image's torch build too (the Dockerfile's default is the CUDA one):
#   make image TORCH_INDEX=https://download.pytorch.org/whl/cpu
image:
	docker build $(if $(TORCH_INDEX),--build-arg TORCH_INDEX=$(TORCH_INDEX)) -t ferry:0.1.0 .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

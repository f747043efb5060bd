# `make demo` and `make test` create .venv on first use and install the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,kron,sweep,search,video,mjx,wandb,minari]'
	touch $(STAMP)

.PHONY: install demo test lint typecheck check bench clean
install: $(STAMP)

# SAC on Pendulum-v1 until it swings up (a few minutes on a 2-core CPU), then its learning curve.
# --overwrite: a second `make demo` moves the previous demo run into runs/demo-sac-pendulum/.replaced-<time>/.
demo: $(STAMP)
	$(BIN)/python scripts/train.py sac --env Pendulum-v1 --total-steps 12000 --learning-starts 1000 \
	    --eval-every 1000 --eval-episodes 5 --run-dir runs/demo-sac-pendulum --overwrite
	$(BIN)/python scripts/plot.py runs/demo-sac-pendulum --out runs/demo-sac-pendulum/curve.png

# Two worker processes (pytest-xdist), each taking whole test files: a file's module fixtures run once.
# A worker that crashes (or that pytest-timeout ends) is not replaced: xdist would run the rest of its
# file again in a new worker, the crashing test included, up to 8 times.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0

# What CI runs before the tests (.ci/run); .pre-commit-config.yaml runs the same two on each commit.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# The contract (agents/api.py, plasticity/api.py), the run machinery (training/) and the Python API.
typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck

bench: $(STAMP)
	$(BIN)/python scripts/benchmark.py

clean:
	rm -rf $(VENV) runs/demo-sac-pendulum

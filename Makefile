# The two commands a new user runs; each sets up .venv (reused when present) first.
.PHONY: setup test test-fast demo bench

# Two workers, a group of tests per worker at a time (a module, or the modules that share a server:
# each server starts once), longest first: tests/conftest.py says how. PARALLEL= runs in one process.
PARALLEL ?= -n 2

setup:
	bash scripts/setup-venv.sh
	bash scripts/setup-test-store.sh

test: setup
	.venv/bin/lint-imports --no-cache
	.venv/bin/python -m pytest -q $(PARALLEL) --durations=20

test-fast: setup
	.venv/bin/python -m pytest -q $(PARALLEL) -m "not vllm and not slow"

demo: setup
	.venv/bin/python -m orca_serve.demo

bench: setup
	.venv/bin/python benchmarks/bench_ltt.py
	.venv/bin/python benchmarks/bench_probe_step.py
	.venv/bin/python benchmarks/bench_train.py

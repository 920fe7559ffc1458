# The two commands a new user runs; each sets up .venv (reused when present) first.
.PHONY: setup test test-fast demo bench

# Two workers, a test module per worker at a time (module-scoped servers start once), modules in
# the order tests/conftest.py gives them (longest first). PARALLEL= runs in one process.
PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder

setup:
	bash scripts/setup-venv.sh

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

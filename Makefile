# The two commands a new user runs; each sets up .venv (reused when present) first.
.PHONY: setup test test-fast demo bench

# Two workers, a group of tests per worker at a time (a module, or the modules that share a server:
# each server starts once), longest first: tests/conftest.py says how. PARALLEL= runs in one process.
# Each worker forks its test servers and calibrate CLI workers from a process that imported vLLM's
# server stack once (tests/zygote.py: ~9 s of CPU a process), and the engine processes vLLM would
# spawn, a server's or the worker's own engines' (TP/PP ranks, the DP server's five), from a copy
# of one (tests/engine_fork.py: ~9 s each); exec'd: what tests the console scripts' start.
# `ORCA_TEST_ZYGOTE=0 make test` execs and spawns them all.
PARALLEL ?= -n 2
# Only the pytest plugins the tests use: autoloaded plugins (schemathesis, anyio, ...) are imported
# and assertion-rewritten by every worker on every run (no bytecode cache where
# PYTHONDONTWRITEBYTECODE is set): 4-5 s of each worker's start.
# This checkout's packages first on the path of the tests and of every process they start: a
# console script (`orca-serve`, `orca-calibrate`) otherwise imports them through the venv's
# editable install, which may be another checkout's (a worktree or clone sharing its .venv).
PYTEST = PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
	.venv/bin/python -m pytest -p xdist.plugin -p _hypothesis_pytestplugin

# Python's bytecode cache on, where the machine turns it off: the install skips compiling
# (scripts/setup-venv.sh) and each module compiles once, on its first import, not in every process.
unexport PYTHONDONTWRITEBYTECODE

setup:
	NO_COMPILE=1 bash scripts/setup-venv.sh
	bash scripts/setup-test-store.sh

test: setup
	.venv/bin/lint-imports --no-cache
	$(PYTEST) -q $(PARALLEL) --durations=20

test-fast: setup
	$(PYTEST) -q $(PARALLEL) -m "not vllm and not slow"

demo: setup
	.venv/bin/python -m orca_serve.startup.demo $(DEMO_ARGS)

bench: setup
	.venv/bin/python benchmarks/bench_ltt.py
	.venv/bin/python benchmarks/bench_probe_step.py
	.venv/bin/python benchmarks/bench_train.py

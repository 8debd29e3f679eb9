# The two commands of the README: `make demo` and `make test`. Each sets up everything
# (OpenMPI, .venv, torch, Horovod, the project) first and reuses what is already there.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test bench clean

setup:
	bash tools/setup.sh

demo: setup
	$(PY) -m regatta demo

test: setup
	REGATTA_REQUIRE_CAPABILITIES=1 $(PY) -m pytest -q -ra --durations=30 $(PYTEST_ARGS)

bench: setup
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf runs .pytest_cache artifacts

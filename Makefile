PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup lint format clean bench browser

# The venv is rebuilt when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch first: on these machines torch==2.13.0 is a local CPU wheel; unpinned would pull CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) pretrain.py --pipeline-model-parallel-size 4 --log-memory-to-tensorboard

test: $(STAMP)
	$(PY) -m pytest -q tests

# The tests that start no process (no job, no gloo world, no subprocess): an edit-test loop's lane.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not world" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) bench/pipeline_vs_torch_pipelining.py
	$(PY) bench/memory_logging_overhead.py
	$(PY) bench/activation_levers.py

# Debian's chromium, for tools/render_html.py (the memory pages as PNG); needs root, as apt-get does.
browser:
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

clean:
	rm -rf $(VENV) runs build *.egg-info

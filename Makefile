# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of this exact version installs from the machine's local disk; a looser
# requirement would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# The transformers release the models are checked against (tests compare logits with it). A new
# release can change a model's maths (5.25 changed NemotronH's dt clamp): bump it on purpose,
# with the suite, never by surprise on a fresh machine. pyproject.toml declares the range users get.
TRANSFORMERS_PIN := transformers==5.25.0

.PHONY: run test test-fast lint bench-capacity clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q $(TRANSFORMERS_PIN) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q $(TORCH_PIN) $(TRANSFORMERS_PIN) -e ".[test]"
	touch $@

run: $(VENV)/.installed
	$(BIN)/hybridkv generate --prompt "def fibonacci(n):" --max-tokens 96 --temperature 0.7 --seed 0

# (worksteal: an idle worker takes queued tests from the busy one, so the long model files at
# the end of the run do not leave a core idle)
test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# everything but the model-conformance matrix, tensor parallelism and the soak test
test-fast: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not conformance and not distributed and not slow"

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

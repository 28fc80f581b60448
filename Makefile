.PHONY: up test test-fast lint format setup bench clean image image-cuda
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(PY) -m tandem up $(ARGS)

# the whole suite (what .ci/run runs); the 25 slowest tests printed keep the tiers' split honest
test: lint
	TANDEM_HYPOTHESIS_PROFILE=full $(PY) -m pytest -q -ra --durations=25 $(ARGS)

# every package in minutes: units, Helm render, the smoke tests (docs/testing.md)
test-fast: lint
	TANDEM_HYPOTHESIS_PROFILE=fast $(PY) -m pytest -q -ra -m "not slow or smoke" --durations=10 $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: $(STAMP)
	$(PY) -m tandem bench $(ARGS)

clean:
	rm -rf $(VENV)

# the images the Helm chart runs, built with buildah from a debootstrapped Debian (docker/build.sh; as root)
image:
	bash docker/build.sh cpu

image-cuda:
	bash docker/build.sh cuda

.PHONY: up test setup bench clean
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(PY) -m tandem up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra $(ARGS)

bench: $(STAMP)
	$(PY) -m tandem bench $(ARGS)

clean:
	rm -rf $(VENV)

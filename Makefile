# The two commands a newcomer needs: `make run` and `make test`. Everything else is set up by them.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[worker,dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	mkdir -p var
	$(BIN)/tula serve --host $(HOST) --port $(PORT) --database-url sqlite:///var/tula.db --executor local --seed-example configs/example_small_cnn.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) var .pytest_cache

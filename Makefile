# The two commands a newcomer needs: `make run` and `make test`. Everything else is set up by them.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed
# The tests run the storage and API tests on a real PostgreSQL too: a private server that
# tests/pg_server.py starts from Debian's `postgresql` package (or the one TULA_TEST_POSTGRES_URL names).
POSTGRES_SERVER_GLOB := /usr/lib/postgresql/*/bin/postgres
APT_GET ?= apt-get
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# The dashboard tests drive Debian's chromium headless with Playwright (its own browser download
# needs the internet, so it is never used).
CHROMIUM := /usr/bin/chromium

.PHONY: run test venv postgres chromium clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[worker,dev,ray,lightning,huggingface]'
	touch $(STAMP)

venv: $(STAMP)

# Installs Debian's postgresql package when its server binaries are missing (sudo when not root).
postgres:
	@if [ -n "$$TULA_TEST_POSTGRES_URL" ]; then \
		echo "tests use the PostgreSQL server at TULA_TEST_POSTGRES_URL"; \
	elif ls $(POSTGRES_SERVER_GLOB) >/dev/null 2>&1; then \
		:; \
	else \
		echo "PostgreSQL server binaries ($(POSTGRES_SERVER_GLOB)) are missing: installing Debian's postgresql package"; \
		command -v $(firstword $(APT_GET)) >/dev/null || { echo "error: no apt-get here: install PostgreSQL or set TULA_TEST_POSTGRES_URL" >&2; exit 1; }; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive $(APT_GET) update \
		&& $(SUDO) env DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y --no-install-recommends postgresql \
		|| { echo "error: could not install Debian's postgresql package; the PostgreSQL tests need it" >&2; exit 1; }; \
		ls $(POSTGRES_SERVER_GLOB) >/dev/null 2>&1 \
		|| { echo "error: postgresql is installed but $(POSTGRES_SERVER_GLOB) is still missing" >&2; exit 1; }; \
	fi

# Installs Debian's chromium package when $(CHROMIUM) is missing (sudo when not root).
chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
		echo "$(CHROMIUM) is missing: installing Debian's chromium package for the dashboard tests"; \
		command -v $(firstword $(APT_GET)) >/dev/null || { echo "error: no apt-get here: install chromium at $(CHROMIUM)" >&2; exit 1; }; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive $(APT_GET) update \
		&& $(SUDO) env DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y --no-install-recommends chromium \
		|| { echo "error: could not install Debian's chromium package; the dashboard tests need it" >&2; exit 1; }; \
		test -x $(CHROMIUM) || { echo "error: chromium is installed but $(CHROMIUM) is still missing" >&2; exit 1; }; \
	fi

run: $(STAMP)
	mkdir -p var
	$(BIN)/tula serve --host $(HOST) --port $(PORT) --database-url sqlite:///var/tula.db --executor local --seed-example configs/example_small_cnn.yaml

test: $(STAMP) postgres chromium
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) var .pytest_cache

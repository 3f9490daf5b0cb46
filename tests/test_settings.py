"""Every TULA_* environment variable goes through one pydantic-settings object (tula_service.settings)."""

import os
import re
from pathlib import Path

import pytest

from tula_service.settings import DEFAULT_MAX_DEVICES, DEFAULT_URL, Environment, environment

REPO = Path(__file__).resolve().parents[1]
TULA_VARIABLE = re.compile(r"TULA_[A-Z_]+")


def test_each_variable_is_parsed(monkeypatch):
    monkeypatch.setenv("TULA_DATABASE_URL", "postgresql+psycopg://tula@db/tula")
    monkeypatch.setenv("TULA_URL", "http://tula.internal:8000")
    monkeypatch.setenv("TULA_TOKEN", "tula_secret")
    monkeypatch.setenv("TULA_ALLOWED_HOSTS", "tula.internal, 10.0.0.5")
    monkeypatch.setenv("TULA_ALLOWED_MODEL_MODULES", "acme.models,lab")
    monkeypatch.setenv("TULA_DATA_ROOTS", os.pathsep.join(["/data/a", "/data/b"]))
    monkeypatch.setenv("TULA_MAX_BATCH_SIZES", "8")
    monkeypatch.setenv("TULA_MAX_DEVICES", "512")
    env = environment()
    assert env.database_url == "postgresql+psycopg://tula@db/tula"
    assert (env.url, env.token) == ("http://tula.internal:8000", "tula_secret")
    assert env.allowed_hosts == ["tula.internal", "10.0.0.5"]
    assert env.allowed_model_modules == ["acme.models", "lab"]
    assert env.data_roots == ["/data/a", "/data/b"]
    assert (env.max_batch_sizes, env.max_devices) == (8, 512)


def test_unset_and_blank_variables_take_their_defaults(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TULA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TULA_MAX_DEVICES", "  ")
    env = environment()
    assert env == Environment(url=DEFAULT_URL)
    assert env.max_devices == DEFAULT_MAX_DEVICES and env.data_roots == [] and env.token is None


@pytest.mark.parametrize("raw", ["0", "-3", "many"])
def test_a_malformed_limit_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("TULA_MAX_BATCH_SIZES", raw)
    with pytest.raises(RuntimeError, match=f"TULA_MAX_BATCH_SIZES='{raw}'"):
        environment()


def test_no_module_reads_a_tula_variable_but_the_settings():
    """os.environ / os.getenv with a TULA_* name (or a *_ENV constant) appear in tula_service.settings only;
    the workers' code (models/, profiler/) gets what it needs in its requests."""
    readers = re.compile(r"os\.(environ\.get\(|getenv\(|environ\[)\s*([A-Z_]+_ENV|\"TULA_)[^=]*$")  # reads, not writes
    offenders = []
    for package in ("tula_service", "models", "profiler"):
        for path in (REPO / package).rglob("*.py"):
            if path.name == "settings.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if readers.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_settings_docstring_lists_every_variable_the_code_names():
    import tula_service.settings as settings

    named = set()
    for package in ("tula_service", "models"):
        for path in (REPO / package).rglob("*.py"):
            named |= set(TULA_VARIABLE.findall(path.read_text()))
    named -= {"TULA_"}
    assert named - set(TULA_VARIABLE.findall(settings.__doc__)) == set()

"""The CLI's two halves: the client commands load nothing of the server, and both halves still
answer on one `tula` command."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

SERVER_MODULES = ("sqlalchemy", "uvicorn", "fastapi", "starlette", "tula_service.api", "tula_service.store.db")


def loaded_after(statement: str) -> list[str]:
    """The server modules a fresh interpreter has loaded after running `statement`."""
    probe = f"import sys\n{statement}\nprint(' '.join(m for m in {SERVER_MODULES!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


# The package too: importing tula_service.cli.client runs tula_service/cli/__init__.py, which imports
# server.py to build the parser, so the server half must leave SQLAlchemy and uvicorn to its commands.
@pytest.mark.parametrize("module", ["tula_service.cli.client", "tula_service.cli.printing", "tula_service.cli.runs", "tula_service.cli"])
def test_importing_the_client_half_loads_no_database_server_or_app(module):
    assert loaded_after(f"import {module}") == []


def test_a_client_command_runs_without_the_storage_layer():
    """`tula --help` builds the parser (job states, catalog kinds) and the typed client imports its
    response models: none of it needs SQLAlchemy (the states live in tula_service.store.states)."""
    statement = "import tula_service.client\nfrom tula_service.cli import build_parser\nbuild_parser()"
    assert loaded_after(statement) == []


def test_one_parser_has_both_halves_commands_in_their_order():
    from tula_service.cli import build_parser

    (commands,) = [action for action in build_parser()._actions if action.dest == "command"]
    assert list(commands.choices) == ["serve", "submit", "status", "show", "plan", "cancel", "delete", "catalog", "run", "token"]

"""`tula`: serve the API; submit, list, show, re-plan, cancel and delete jobs; start and follow runs; manage API
tokens.

Two halves, one parser:
- `server.py`: `tula serve` and `tula token ...`, on the database (`--database-url`, default
  $TULA_DATABASE_URL);
- `client.py`: every command that talks to a server, through `tula_service.client.TulaClient`
  (`--server`, default $TULA_URL; `--token`, default $TULA_TOKEN), and `printing.py`, what it prints;
  `runs.py`: `tula run ...`, a training run's start, advice and telemetry upload, through the same client.

Each half turns what can go wrong on its side (a database, a server) into a `CliError`; `_run` prints
any mistake as one `error: ...` on stderr and exits 2, never with a traceback (exit statuses:
`common.EXIT_*`, docs/cli.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from tula_service.cli import client, runs, server
from tula_service.cli.common import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_MISTAKE, CliError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tula", description="Tula batch-size optimizer")
    sub = parser.add_subparsers(dest="command", required=True)
    server.add_serve(sub)  # in this order, as `tula --help` lists them
    client.add_commands(sub)
    runs.add_run(sub)
    server.add_token(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    """The command; every mistake a user can make ends as `error: ...` on stderr and EXIT_MISTAKE."""
    try:
        return args.func(args)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
    except BrokenPipeError:
        raise  # main's: stdout closed early is no error to report
    except OSError as error:  # a local file or folder: the SQLite database's, a spec the server seeds
        print(f"error: {error.strerror or error}" + (f": {error.filename}" if error.filename else ""), file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_MISTAKE


def main(argv: list[str] | None = None) -> int:
    try:
        status = _run(build_parser().parse_args(argv))
        sys.stdout.flush()  # a reader that went away shows here, not as a message at exit
    except BrokenPipeError:
        # `tula catalog models | head -1`: the reader has what it wanted. Point stdout at /dev/null so
        # the interpreter's own flush at exit cannot fail too, and stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return status

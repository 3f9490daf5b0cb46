"""The server side of `tula`: `tula serve` and `tula token create|list|revoke`, which work on the
database itself (`--database-url`, default $TULA_DATABASE_URL), since the first token has to exist
before a server can ask for one.

SQLAlchemy, uvicorn and the app are imported when a command runs, not with this module: `tula
submit` and the other client commands parse their arguments next to these and should not load them.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from models.data_roots import DATA_ROOTS_ENV
from tula_service.cli.common import CliError, one_line, positive_int, table, when
from tula_service.settings import environment

Command = Callable[[argparse.Namespace], int]


def on_the_database(command: Command) -> Command:
    """The command, with the database's failures as a CliError: a URL SQLAlchemy cannot use, or a
    database it cannot open or read."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import ArgumentError, SQLAlchemyError

        try:
            return command(args)
        except ArgumentError as error:  # also an unknown driver (NoSuchModuleError)
            raise CliError(f"not a database URL (--database-url, $TULA_DATABASE_URL): {error}") from None
        except SQLAlchemyError as error:
            raise CliError(f"cannot use the database: {one_line(str(getattr(error, 'orig', None) or error), 200)}") from None

    return run


def _engine(database_url: str):
    from tula_service.store.db import make_engine

    if database_url.startswith("sqlite:///"):
        Path(database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return make_engine(database_url)


def _sessions(database_url: str):
    from tula_service.store.db import make_session_factory

    return make_session_factory(_engine(database_url))


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return args.database_url
    from tula_service.api import default_database_url  # imported only when needed: it loads the catalogs

    return default_database_url()


@on_the_database
def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tula_service.api import Settings, create_app
    from tula_service.api.auth import is_loopback, listen_refusal
    from tula_service.api.security import allowed_hosts_from_env, host_pattern_problem, served_hosts
    from tula_service.store.db import make_session_factory
    from tula_service.store.tokens import any_active_token

    if args.ray_address and args.executor != "ray":
        raise CliError("--ray-address needs --executor ray")
    extra_hosts = args.allowed_host if args.allowed_host is not None else allowed_hosts_from_env()
    problems = [problem for host in extra_hosts if (problem := host_pattern_problem(host))]
    if problems:
        raise CliError(("--allowed-host " if args.allowed_host is not None else "TULA_ALLOWED_HOSTS ") + "; ".join(problems))
    allowed_hosts = served_hosts(args.host, extra_hosts)
    if args.data_root:  # the spec check and every local or Ray worker read them from here (models.data_roots)
        os.environ[DATA_ROOTS_ENV] = os.pathsep.join(os.path.abspath(os.path.expanduser(root)) for root in args.data_root)
    database_url = _database_url(args)
    engine = _engine(database_url)
    tokens_exist = any_active_token(make_session_factory(engine))
    engine.dispose()
    refusal = listen_refusal(args.host, args.insecure, tokens_exist)
    if refusal:
        raise CliError(refusal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {"max_request_bytes": args.max_request_bytes} if args.max_request_bytes else {}
    settings = Settings(
        database_url=database_url,
        executor=args.executor,
        workers=args.workers,
        ray_address=args.ray_address,
        seed_example=Path(args.seed_example) if args.seed_example else None,
        public_reads=args.public_reads,
        require_token=not args.insecure and not is_loopback(args.host),
        allowed_hosts=allowed_hosts,
        **overrides,
    )
    app = create_app(settings)
    base = f"http://{args.host}:{args.port}"
    if tokens_exist:
        auth = "API token required for /v1" + (" writes (reads are public)" if args.public_reads else "")
    else:
        auth = "open: no API token exists (create one with `tula token create --name NAME`)"
    print(f"Tula API:       {base}/v1/jobs", flush=True)
    print(f"API docs:       {base}/docs", flush=True)
    print(f"Database:       {database_url}", flush=True)
    print(f"Executor:       {args.executor}", flush=True)
    roots = environment().data_roots
    print(f"Data roots:     {', '.join(roots) if roots else 'none: file datasets are refused (--data-root DIR allows one)'}", flush=True)
    print(f"Auth:           {auth}", flush=True)
    print(f"Allowed hosts:  {', '.join(allowed_hosts)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


@on_the_database
def _token_create(args: argparse.Namespace) -> int:
    from tula_service.store.tokens import InvalidTokenName, create_token

    try:
        info, plaintext = create_token(_sessions(_database_url(args)), args.name)
    except InvalidTokenName as error:
        raise CliError(str(error)) from None
    print(plaintext, flush=True)
    print(
        f"created token '{info.name}' ({info.prefix}...). It is shown only this once: store it now "
        "(clients read it from --token or TULA_TOKEN). Servers on this database require it within a second.",
        file=sys.stderr,
    )
    return 0


@on_the_database
def _token_list(args: argparse.Namespace) -> int:
    from tula_service.store.tokens import list_tokens

    tokens = list_tokens(_sessions(_database_url(args)), include_revoked=True)
    if args.json:
        print(json.dumps([{**vars(t), "active": t.active} for t in tokens], indent=2, default=str))
        return 0
    if not tokens:
        print("no tokens: the API is open to anyone who can reach it (create one with `tula token create --name NAME`)")
        return 0
    rows = [[t.name, t.prefix + "...", when(t.created_at), when(t.last_used_at), when(t.revoked_at)] for t in tokens]
    print(table(["NAME", "PREFIX", "CREATED (UTC)", "LAST USED", "REVOKED"], rows))
    return 0


@on_the_database
def _token_revoke(args: argparse.Namespace) -> int:
    from tula_service.store.tokens import revoke_token

    revoked = revoke_token(_sessions(_database_url(args)), args.name_or_prefix)
    if revoked == 0:
        raise CliError(f"no active token is named or prefixed '{args.name_or_prefix}' (see `tula token list`)")
    print(f"revoked {revoked} token{'s' if revoked > 1 else ''} '{args.name_or_prefix}'; servers refuse it within a second")
    return 0


def _database_option() -> argparse.ArgumentParser:
    database = argparse.ArgumentParser(add_help=False)
    database.add_argument("--database-url", help="default: $TULA_DATABASE_URL or sqlite:///var/tula.db")
    return database


def add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", parents=[_database_option()], help="run the API server and its executor")
    serve.add_argument("--host", default="127.0.0.1", help="any address but loopback needs an API token or --insecure")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--executor", default="local", choices=["local", "ray", "none"],
                       help="none: API only (another server on the same database runs the points)")
    serve.add_argument("--ray-address", help="with --executor ray: the cluster to join (default: start a local one)")
    serve.add_argument("--workers", type=positive_int, default=None,
                       help="points profiled at once (default: one per GPU, one on a host without GPUs)")
    serve.add_argument("--seed-example", help="spec file submitted when the database is empty")
    serve.add_argument("--insecure", action="store_true", help="listen on a non-loopback address with no API token")
    serve.add_argument("--public-reads", action="store_true",
                       help="with tokens configured, reads need none: GETs and what-ifs (POST /v1/jobs/ID/plan)")
    serve.add_argument("--data-root", action="append", default=None, metavar="DIR",
                       help=f"a folder file datasets may be read from (repeatable; default ${DATA_ROOTS_ENV}); none: no file datasets")
    serve.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                       help="a Host name the server answers to besides --host and localhost (repeat it; "
                       "'*.example.com' for subdomains, '*' for any; default: $TULA_ALLOWED_HOSTS, comma-separated)")
    serve.add_argument("--max-request-bytes", type=positive_int, default=None, help="largest request body accepted")
    serve.set_defaults(func=_serve)


def add_token(sub: argparse._SubParsersAction) -> None:
    token = sub.add_parser("token", help="create, list or revoke API tokens (on the database)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    database = _database_option()
    create = token_sub.add_parser("create", parents=[database], help="create a token; it is printed once")
    create.add_argument("--name", required=True, help="1-100 of A-Z a-z 0-9 . _ -")
    create.set_defaults(func=_token_create)
    listing = token_sub.add_parser("list", parents=[database], help="every token, never the token itself")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_token_list)
    revoke = token_sub.add_parser("revoke", parents=[database], help="revoke tokens by name or prefix")
    revoke.add_argument("name_or_prefix")
    revoke.set_defaults(func=_token_revoke)

"""`tula`: serve the API; submit, list, show, re-plan, cancel and delete jobs; manage API tokens.

Every command that talks to a server goes through `tula_service.client.TulaClient` and takes
`--server` (default $TULA_URL) and `--token` (default $TULA_TOKEN). `tula token ...` works on the
database itself (`--database-url`, default $TULA_DATABASE_URL), since the first token has to exist
before a server can ask for one. Mistakes are one line per problem and exit status 2; no user error
prints a traceback (exit statuses: `EXIT_*` below, docs/cli.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, get_args

import httpx
from pydantic import ValidationError
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from models.data_roots import DATA_ROOTS_ENV
from tula_service.client import CATALOG_KINDS, TulaClient, TulaError
from tula_service.settings import environment
from tula_service.db import ACTIVE_JOB_STATES, ACTIVE_POINT_STATES, JOB_STATES, TERMINAL_JOB_STATES
from tula_service.schemas import JobView
from tula_service.spec import Objective, PricingKind
from tula_service.units import GIB, KIB, MIB, TIB

EXIT_JOB_NOT_DONE = 1  # `submit --wait`: the job failed or was cancelled; `show`: the job failed
EXIT_MISTAKE = 2  # a bad argument or file, a refusal by the server, a server that cannot be reached
EXIT_WAIT_TIMEOUT = 124  # `submit --wait --timeout-s`: the job is still running (as timeout(1) exits)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # stdout closed early, `tula ... | head -1` (128 + SIGPIPE, as `yes | head -1`)
HOURS_PER_UNIT = {"": 1.0, "s": 1 / 3600, "sec": 1 / 3600, "m": 1 / 60, "min": 1 / 60, "h": 1.0, "hr": 1.0, "d": 24.0}
TOKEN_HINT = "pass the API token with --token TOKEN or in the TULA_TOKEN environment variable"


class CliError(Exception):
    """A mistake on the command line: printed as `error: ...`, exit status 2."""


# --- argument types --------------------------------------------------------------------------------


def duration_h(text: str) -> float:
    """`4h`, `90m`, `2.5h`, `1d`, `3600s`; a bare number is hours."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in HOURS_PER_UNIT:
        raise argparse.ArgumentTypeError(f"'{text}' is not a duration: use e.g. 4h, 90m, 2.5h, 1d, 3600s or hours")
    hours = float(match.group(1)) * HOURS_PER_UNIT[match.group(2)]
    if hours <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive duration")
    return hours


Number = TypeVar("Number", int, float)


def positive(number: Callable[[str], Number]) -> Callable[[str], Number]:
    """An argparse type: `positive(int)` takes a whole number >= 1, `positive(float)` a number > 0."""
    noun, bound = ("a whole number", "at least 1") if number is int else ("a number", "greater than 0")

    def parse(text: str) -> Number:
        try:
            value = number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not {noun}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"'{text}' must be {bound}")
        return value

    return parse


positive_int, positive_float = positive(int), positive(float)


# --- numbers for people: three significant digits in a unit chosen for the size (--json is exact) ---


def human_number(value: float, digits: int = 3) -> str:
    """`digits` significant digits, thousands separated, no exponent and no trailing zeros:
    22.48828125 -> 22.5, 140.4 -> 140, 40.0 -> 40, 0.006123 -> 0.00612, 12440 -> 12,440."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{round(value, decimals):,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(value: float, units: tuple[tuple[float, str], ...]) -> str:
    """value in the largest unit it reaches (the first when it reaches none), or the next one when it
    rounds up to that: 1023.9 MiB is 1 GiB, 59.99 min is 1 h."""
    index = max((i for i, (size, _) in enumerate(units) if abs(value) >= size), default=0)
    text = human_number(value / units[index][0])
    if index + 1 < len(units) and abs(float(text.replace(",", ""))) * units[index][0] >= units[index + 1][0]:
        index += 1
        text = human_number(value / units[index][0])
    return f"{text} {units[index][1]}"


def human_bytes(count: float) -> str:
    """6.5e6 -> 6.2 MiB; 2.4147e10 -> 22.5 GiB."""
    return _scaled(count, ((1, "B"), (KIB, "KiB"), (MIB, "MiB"), (GIB, "GiB"), (TIB, "TiB")))


def human_bandwidth(gbit_per_s: float) -> str:
    """In bytes per second, as datasheets give it: 12440 Gbit/s -> 1.56 TB/s."""
    return _scaled(gbit_per_s * 1e9 / 8, ((1e6, "MB/s"), (1e9, "GB/s"), (1e12, "TB/s")))


def human_duration(seconds: float) -> str:
    """0.3215 -> 322 ms; 3747 -> 1.04 h; a day and more in days."""
    if seconds == 0:
        return "0 s"
    return _scaled(seconds, ((1e-3, "ms"), (1, "s"), (60, "min"), (3600, "h"), (86400, "d")))


def human_usd(amount: float) -> str:
    """Cents, thousands separated ($1,234.57; $1.01 for 1.006); under a cent, two significant digits."""
    if 0 < abs(amount) < 0.01:
        return f"${human_number(amount, 2)}"
    return f"${amount:,.2f}"


# --- serve and tokens: on the database --------------------------------------------------------------


def _engine(database_url: str):
    from tula_service.db import make_engine

    if database_url.startswith("sqlite:///"):
        Path(database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return make_engine(database_url)


def _sessions(database_url: str):
    from tula_service.db import make_session_factory

    return make_session_factory(_engine(database_url))


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return args.database_url
    from tula_service.api import default_database_url  # imported only when needed: it loads the catalogs

    return default_database_url()


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tula_service.api import Settings, create_app
    from tula_service.auth import is_loopback, listen_refusal
    from tula_service.db import make_session_factory
    from tula_service.security import allowed_hosts_from_env, host_pattern_problem, served_hosts
    from tula_service.tokens import any_active_token

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
    print(f"Data roots:     {', '.join(roots) if roots else f'none: file datasets are refused (--data-root DIR allows one)'}", flush=True)
    print(f"Auth:           {auth}", flush=True)
    print(f"Allowed hosts:  {', '.join(allowed_hosts)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def _token_create(args: argparse.Namespace) -> int:
    from tula_service.tokens import InvalidTokenName, create_token

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


def _token_list(args: argparse.Namespace) -> int:
    from tula_service.tokens import list_tokens

    tokens = list_tokens(_sessions(_database_url(args)), include_revoked=True)
    if args.json:
        print(json.dumps([{**vars(t), "active": t.active} for t in tokens], indent=2, default=str))
        return 0
    if not tokens:
        print("no tokens: the API is open to anyone who can reach it (create one with `tula token create --name NAME`)")
        return 0
    rows = [[t.name, t.prefix + "...", _when(t.created_at), _when(t.last_used_at), _when(t.revoked_at)] for t in tokens]
    print(_table(["NAME", "PREFIX", "CREATED (UTC)", "LAST USED", "REVOKED"], rows))
    return 0


def _token_revoke(args: argparse.Namespace) -> int:
    from tula_service.tokens import revoke_token

    revoked = revoke_token(_sessions(_database_url(args)), args.name_or_prefix)
    if revoked == 0:
        raise CliError(f"no active token is named or prefixed '{args.name_or_prefix}' (see `tula token list`)")
    print(f"revoked {revoked} token{'s' if revoked > 1 else ''} '{args.name_or_prefix}'; servers refuse it within a second")
    return 0


# --- client commands ---------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> TulaClient:
    return TulaClient(args.server, token=args.token)


def _reference_stats(path: str) -> list[dict[str, Any]]:
    """The records of `--reference-stats FILE` (JSONL or a JSON list), each checked."""
    from tula_service.gradient_stats_file import coarsen_records, read_gradient_stats
    from tula_service.spec import MAX_GRADIENT_STATS_RECORDS
    from tula_service.specfile import FileRefused

    try:
        records = read_gradient_stats(path)
    except OSError as error:
        raise CliError(f"cannot read reference stats {path}: {error.strerror}") from None
    except FileRefused as error:
        raise CliError(f"--reference-stats: {error}") from None
    except ValueError as error:
        problems = "\n".join(f"  {line}" for line in str(error).splitlines())  # one line per problem, the first 20
        raise CliError(f"{path} is not a gradient-statistics file:\n{problems}") from None
    if len(records) > MAX_GRADIENT_STATS_RECORDS:
        merged = coarsen_records(records, MAX_GRADIENT_STATS_RECORDS)
        print(f"reference stats: {len(records)} records merged into {len(merged)} windows (a job holds at most "
              f"{MAX_GRADIENT_STATS_RECORDS}; numerators and denominators are pooled, so the noise scale is unchanged)",
              file=sys.stderr)  # fmt: skip
        records = merged
    return records


def with_reference_stats(spec: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The spec with `training.reference_run.gradient_stats` set to the records (replacing any)."""
    training = spec.setdefault("training", {})
    reference_run = (training.get("reference_run") or {}) if isinstance(training, dict) else None
    if not isinstance(reference_run, dict):
        raise CliError("--reference-stats needs the spec's training and training.reference_run to be mappings of fields")
    training["reference_run"] = {**reference_run, "gradient_stats": records}
    return spec


def _validated_spec(path: str, reference_stats: str | None = None) -> dict[str, Any]:
    """The spec file, parsed (specfile: size-limited, safe YAML, errors with line and column) and
    validated here, so a mistake is named before anything is sent."""
    from tula_service.spec import JobSpec  # the catalogs behind it take a second to import
    from tula_service.specfile import load_spec_file

    try:
        data = load_spec_file(path)
        if reference_stats is not None:
            with_reference_stats(data, _reference_stats(reference_stats))
        JobSpec.model_validate(data)  # fail here, naming the field, before anything is sent
    except OSError as error:
        raise CliError(f"cannot read spec {path}: {error.strerror}") from None
    except ValidationError as error:
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()]
        raise CliError(f"{path} is not a valid job spec:\n" + "\n".join(lines)) from None
    except ValueError as error:
        raise CliError(str(error)) from None
    return data


class ProgressPrinter:
    """A live bar on a terminal; one line per change otherwise (logs, CI)."""

    def __init__(self, stream=sys.stdout, width: int = 30):
        self.stream = stream
        self.width = width
        self._last: tuple | None = None
        self._shown = 0

    def __call__(self, job: JobView) -> None:
        done, total, step = job.progress.points_done, job.progress.points_total, job.progress.step
        if (done, job.state, step) == self._last:
            return
        self._last = (done, job.state, step)
        filled = int(self.width * done / total) if total else self.width
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} points  {job.state:<10}"
        if step and step != job.state:
            line += f"  {step}"
        if self.stream.isatty():
            print(f"\r{line:<{self._shown}}", end="", file=self.stream, flush=True)
            self._shown = len(line)
        else:
            print(line.rstrip(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.stream.isatty():
            print(file=self.stream)


def format_recommendation(rec: dict[str, Any]) -> str:
    chosen = rec["chosen"]
    reliability = rec.get("reliability") or {}
    lines = [] if reliability.get("verdict") != "unreliable" else [
        f"WARNING: {reliability['message']}", *(f"  - {reason}" for reason in reliability["reasons"]), "",
    ]  # fmt: skip
    lines += [
        f"objective: {rec['objective']}"
        + (f"  (knee by {rec['knee']['method']}, S={rec['knee']['sensitivity']}, on {rec['knee']['curve']})" if rec.get("knee") else ""),
        f"chosen: global batch {chosen['global_batch']} = device batch {chosen['device_batch']}"
        f" x {chosen['devices']} devices x {chosen['accumulation']} accumulation",
        f"  predicted total time {human_duration(chosen['total_time_s']['value'])},"
        f" cost {human_usd(chosen['cost_usd']['value'])}, memory {human_bytes(chosen['memory_bytes']['value'])}"
        f" ({chosen['memory_bytes']['source']}), epochs {human_number(chosen['epochs']['value'])} ({chosen['epochs']['source']})",
    ]
    knee = rec.get("knee") or {}
    if knee.get("method_explained") and rec["objective"] == "knee":
        lines.append(f"  {knee['method']}: {knee['method_explained']}")
    if rec.get("constraint"):
        lines.append(f"  {rec['constraint']['message']}")
    advice = rec.get("training_advice")
    if advice:
        lr, ags, ramp = advice["lr_rule"], advice["ags"], advice["batch_ramp"]
        lines.append(
            f"  LR x{lr['multiplier']['value']:.2f} ({lr['recommended']}, {lr['multiplier']['source']})"
            + (f" = {lr['lr']['value']:.4g}" if lr.get("lr") else "")
            + f"; warm-up {advice['warmup']['steps']} steps; AGS delta={ags['delta']['value']:.3g} s={ags['s']['value']:.3g}"
        )
        if len(ramp["stages"]) > 1:
            lines.append("  batch ramp: " + ", ".join(f"{st['global_batch']} from {st['from_epoch_fraction']:.0%}" for st in ramp["stages"]))
    front = sorted((c for c in rec["candidates"] if c["pareto"]), key=lambda c: c["global_batch"])
    rows = [
        [c["global_batch"], c["device_batch"], c["devices"], c["accumulation"], human_bytes(c["memory_bytes"]["value"]),
         human_duration(c["iter_time_s"]["value"]), human_duration(c["total_time_s"]["value"]), human_usd(c["cost_usd"]["value"])]
        for c in front
    ]  # fmt: skip
    lines += ["", _table(["BATCH", "DEVICE_B", "DEVICES", "ACC", "MEMORY", "ITER", "TOTAL", "COST"], rows, align=">")]
    lines.append(f"({len(rec['candidates'])} candidates in all; Pareto front shown; --json for everything)")
    return "\n".join(lines)


def _table(headers: list[str], rows: list[list[Any]], align: str = "<") -> str:
    """Columns as wide as their widest cell; align ">" right-aligns every column (numbers)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return "\n".join(
        "  ".join(f"{str(cell):{align}{width}}" for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]
    )


def _points(job: JobView) -> str:
    return f"{job.progress.points_done}/{job.progress.points_total}"


def _submit(args: argparse.Namespace) -> int:
    spec = _validated_spec(args.spec, args.reference_stats)
    # With --json, stdout is one JSON document; the narration goes to stderr.
    narration = sys.stderr if args.json else sys.stdout
    if args.reference_stats:
        records = spec["training"]["reference_run"]["gradient_stats"]
        print(f"reference run: {len(records)} gradient-statistics records from {args.reference_stats}", file=narration, flush=True)
    with _client(args) as client:
        job = client.submit(spec, idempotency_key=args.idempotency_key)
        print(f"submitted job {job.id} ({job.progress.points_total} points)", file=narration, flush=True)
        if not args.wait:
            if args.json:
                print(job.model_dump_json(indent=2))
            return 0
        progress = ProgressPrinter(narration)
        try:
            job = client.wait(job.id, poll_s=args.poll_s, timeout_s=args.timeout_s, on_progress=progress)
        except KeyboardInterrupt:
            progress.close()
            print(f"stopped waiting; job {job.id} goes on (`tula cancel {job.id}` stops it)", file=sys.stderr)
            return EXIT_INTERRUPTED
        except TimeoutError as error:
            progress.close()
            print(f"stopped waiting: {error}; it goes on (`tula show {job.id}`, `tula cancel {job.id}`)", file=sys.stderr)
            return EXIT_WAIT_TIMEOUT
        progress.close()
        if job.state != "done":
            print(f"job {job.id} {job.state}" + (f": {job.error}" if job.error else ""), file=sys.stderr)
            return EXIT_JOB_NOT_DONE
        rec = client.recommendation(job.id)
        print(json.dumps(rec, indent=2) if args.json else format_recommendation(rec))
    return 0


def _chosen_summary(chosen: dict[str, Any] | None) -> str:
    if not chosen:
        return "-"
    accumulation = f" x{chosen['accumulation']} acc" if chosen.get("accumulation", 1) > 1 else ""
    return f"{chosen['global_batch']} on {chosen['devices']} dev{accumulation}"


def _status(args: argparse.Namespace) -> int:
    jobs: list[JobView] = []
    total = 0
    with _client(args) as client:
        offset: int | None = 0
        while offset is not None and len(jobs) < args.limit:
            page = client.jobs(args.state, limit=min(500, args.limit - len(jobs)), offset=offset)
            jobs += page.jobs
            total, offset = page.total, page.next_offset
    if args.json:
        print(json.dumps({"total": total, "jobs": [job.model_dump(mode="json") for job in jobs]}, indent=2))
        return 0
    if not jobs:
        print("no jobs" + (f" in state {', '.join(args.state)}" if args.state else ""))
        return 0
    rows = [
        [job.id, job.name or "-", job.model, job.state, _points(job), _chosen_summary(job.chosen), _when(job.created_at)]
        for job in jobs
    ]
    print(_table(["ID", "NAME", "MODEL", "STATE", "POINTS", "CHOSEN (batch on devices)", "CREATED (UTC)"], rows))
    if total > len(jobs):
        print(f"({len(jobs)} of {total} jobs shown; --limit for more)")
    return 0


def _point_label(kind: str, batch_size: int | None) -> str:
    if kind == "comm":
        return "all-reduce"
    return f"{batch_size}" + {"search": " (search)", "pilot": " (pilot)"}.get(kind, "")


def _one_line(text: str | None, width: int = 90) -> str:
    if not text:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def describe_job(job: JobView) -> str:
    progress = job.progress
    lines = [
        f"job {job.id}" + (f" ({job.name})" if job.name else "") + f": {job.state}, {_points(job)} points"
        + (f", {progress.points_failed} failed" if progress.points_failed else "")
        + (f", {progress.points_retried} retried" if progress.points_retried else ""),
        f"  {job.model} on {job.dataset}; created {_when(job.created_at)}"
        + (f", finished {_when(job.finished_at)}" if job.finished_at else "") + " (UTC)",
    ]
    if job.state in ACTIVE_JOB_STATES and progress.step:
        lines.append(f"  now: {progress.step}")
    if job.error:
        lines.append(f"  error: {job.error}")
    if job.points:
        rows = [
            [_point_label(p.kind, p.batch_size), p.state, str(p.attempts),
             human_duration(p.duration_s) if p.duration_s is not None else "-", _one_line(p.error)]
            for p in job.points
        ]  # fmt: skip
        lines += ["", _table(["BATCH", "STATE", "ATTEMPTS", "DURATION", "ERROR"], rows)]
    if job.state in TERMINAL_JOB_STATES:
        groups = {"out of memory": ("oom",), "failed": ("failed",), "not measured": (*ACTIVE_POINT_STATES, "cancelled")}
        for title, states in groups.items():
            labels = [_point_label(p.kind, p.batch_size) for p in job.points if p.state in states]
            if labels:
                lines.append(f"{title}: batch {', '.join(labels)}")
    return "\n".join(lines)


def _show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.job(args.job_id)
        rec = client.recommendation(job.id) if job.state == "done" else None
    if args.json:
        print(json.dumps({"job": job.model_dump(mode="json"), "recommendation": rec}, indent=2))
    else:
        print(describe_job(job))
        if rec is not None:
            print("\n" + format_recommendation(rec))
    return EXIT_JOB_NOT_DONE if job.state == "failed" else 0


def _node_split(gpus: int, gpus_per_node: int) -> str:
    per_node = max(d for d in range(1, gpus_per_node + 1) if gpus % d == 0)
    return f"--nodes {gpus // per_node} --gpus-per-node {per_node}"


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_what_if(args: argparse.Namespace, spec: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The what-if body for `tula plan` and, in words, what it changes in the job's stored spec and
    which given values the spec has already."""
    cluster: dict[str, Any] = {}
    gpus_per_node = args.gpus_per_node or spec["cluster"]["gpus_per_node"]
    if args.gpus_per_node is not None:
        cluster["gpus_per_node"] = args.gpus_per_node
    if args.nodes is not None:
        cluster["nodes"] = args.nodes
    if args.gpus is not None:
        if args.nodes is not None and args.nodes * gpus_per_node != args.gpus:
            raise CliError(f"--gpus {args.gpus} is not --nodes {args.nodes} x {gpus_per_node} GPUs per node")
        if args.gpus % gpus_per_node:
            raise CliError(
                f"--gpus {args.gpus} is not a whole number of nodes of {gpus_per_node} GPUs "
                f"(cluster.gpus_per_node); give the split instead, e.g. {_node_split(args.gpus, gpus_per_node)}"
            )
        cluster["nodes"] = args.gpus // gpus_per_node
    if args.gpu_type is not None:
        cluster["gpu_type"] = args.gpu_type
    if args.device_memory_gib is not None:
        cluster["device_memory_gib"] = args.device_memory_gib
    pricing: dict[str, Any] = {}
    if args.pricing_kind is not None:
        pricing["kind"] = args.pricing_kind
    if args.price is not None:
        pricing["price"] = args.price
    training = {key: value for key, value in (("reference_epochs", args.reference_epochs), ("reference_lr", args.reference_lr),
                                              ("max_lr", args.max_lr)) if value is not None}  # fmt: skip

    objective = args.objective
    if objective is None and (args.deadline_h is not None or args.budget is not None):
        if args.deadline_h is not None and args.budget is not None:
            raise CliError("--deadline and --budget given: say which one counts with --objective deadline|budget")
        objective = "deadline" if args.deadline_h is not None else "budget"
    if objective == "deadline" and args.deadline_h is None and spec.get("deadline_h") is None:
        raise CliError("--objective deadline needs --deadline (e.g. --deadline 4h, 90m, 1d)")
    if objective == "budget" and args.budget is None and spec.get("budget_usd") is None:
        raise CliError("--objective budget needs --budget USD")

    # Every value given is sent, even one equal to the stored value: it still says where the value
    # comes from (a price given with a new --gpu-type is kept, a catalog one would be re-derived).
    # In words, only what differs is a change; a value the job already has is named as unchanged.
    what_if: dict[str, Any] = {}
    changes: list[str] = []
    unchanged: list[str] = []

    def compare(name: str, stored: Any, given: Any) -> None:
        if stored == given:
            unchanged.append(f"{name} {_shown(given)}")
        else:
            changes.append(f"{name} {_shown(stored)} -> {_shown(given)}")

    for section, overrides in (("cluster", cluster), ("pricing", pricing), ("training", training)):
        if overrides:
            what_if[section] = overrides
            for key, value in overrides.items():
                compare(f"{section}.{key}", spec[section].get(key), value)
        if section == "cluster":
            before, after = spec["cluster"], {**spec["cluster"], **overrides}
            devices_before, devices_after = before["nodes"] * before["gpus_per_node"], after["nodes"] * after["gpus_per_node"]
            if devices_before != devices_after:
                changes.append(f"devices {devices_before} -> {devices_after}")
    for key, value in (("objective", objective), ("deadline_h", args.deadline_h), ("budget_usd", args.budget)):
        if value is not None:
            what_if[key] = value
            compare(key, spec.get(key), value)
    return what_if, changes, unchanged


def describe_what_if(job_id: str, changes: list[str], unchanged: list[str]) -> str:
    if changes:
        return f"what-if for job {job_id}: " + "; ".join(changes) + (f" (unchanged: {', '.join(unchanged)})" if unchanged else "")
    if unchanged:
        already = f"{unchanged[0]} is the job's value" if len(unchanged) == 1 else f"{', '.join(unchanged)} are the job's values"
        return f"what-if for job {job_id}: nothing changes ({already} already); the stored spec re-planned"
    return f"what-if for job {job_id}: no changes (the stored spec re-planned)"


def _compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What differs from the stored recommendation, as shown (a time equal to three digits is the same)."""
    old, new = before["chosen"], after["chosen"]
    shown = [
        ("global batch", str(old["global_batch"]), str(new["global_batch"])),
        ("devices", str(old["devices"]), str(new["devices"])),
        ("total time", human_duration(old["total_time_s"]["value"]), human_duration(new["total_time_s"]["value"])),
        ("cost", human_usd(old["cost_usd"]["value"]), human_usd(new["cost_usd"]["value"])),
    ]
    changed = [f"{name} {was} -> {now}" for name, was, now in shown if was != now]
    same = [f"{name} {was}" for name, was, now in shown if was == now]
    if not changed:
        return "the same as the stored recommendation: " + ", ".join(same)
    return "compared with the stored recommendation: " + ", ".join(changed) + (f" (unchanged: {', '.join(same)})" if same else "")


def _plan(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.job(args.job_id)
        what_if, changes, unchanged = build_what_if(args, job.spec)
        result = client.plan(job.id, what_if)
        if args.json:
            print(json.dumps(result, indent=2))
            return 0
        before = client.recommendation(job.id)
    print(describe_what_if(job.id, changes, unchanged))
    print(format_recommendation(result))
    print(_compare(before, result))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job_id)
    measured = job.progress.points_measured
    print(f"job {job.id}: {job.state} ({measured} of {job.progress.points_total} points measured"
          + (")" if measured else "; nothing was measured)"))
    return 0


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete(args.job_id)
    print(f"deleted job {args.job_id}")
    return 0


def format_gpu_catalog(gpus: list[dict[str, Any]]) -> str:
    """One row per GPU in human units; the datasheet notes and exact values are in --json."""

    def unit(value: Any, shown) -> str:
        return "-" if value is None else shown(value)

    rows = [
        [gpu["name"], unit(gpu.get("memory_gib"), lambda gib: human_bytes(gib * GIB)),
         unit(gpu.get("memory_bandwidth_gbps"), human_bandwidth),
         unit(gpu.get("peak_bf16_tflops"), lambda tflops: f"{human_number(tflops)} TFLOPS"),
         gpu.get("intra_node_link") or "-", unit(gpu.get("default_price_usd_per_hour"), lambda usd: f"{human_usd(usd)}/GPU-hour"),
         gpu.get("source") or "-"]
        for gpu in gpus
    ]  # fmt: skip
    headers = ["NAME", "MEMORY", "BANDWIDTH", "BF16 DENSE", "LINK", "PRICE", "SOURCE"]
    return _table(headers, rows) + "\n(datasheet notes and exact values: --json)"


def _catalog(args: argparse.Namespace) -> int:
    with _client(args) as client:
        listing = client.catalog(args.kind)
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    if not isinstance(listing.get(args.kind), list):
        raise CliError(f"{_server_url(args)} did not answer as a Tula server does (its catalog has no '{args.kind}' list)")
    if args.kind == "gpus":
        print(format_gpu_catalog(listing["gpus"]))
        return 0
    for entry in listing[args.kind]:
        extras = entry.get("options") or entry.get("fields") or {}
        settings = ", ".join(f"{k}={human_number(v) if isinstance(v, float) else v}" for k, v in extras.items())
        print(f"{entry['name']:<22} {entry['input_kind']:<9} {settings}".rstrip())
    if args.kind == "models":
        allowed = listing["user_models"]["allowed_module_prefixes"]
        print(f"\nuser models 'module:factory': allowed prefixes {allowed or 'none'} (server env {listing['user_models']['env']})")
    return 0


# --- the parser --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tula", description="Tula batch-size optimizer")
    sub = parser.add_subparsers(dest="command", required=True)

    client_options = argparse.ArgumentParser(add_help=False)
    client_options.add_argument("--server", help="API base URL (default: $TULA_URL or http://127.0.0.1:8000)")
    client_options.add_argument("--token", help="API token (default: $TULA_TOKEN)")
    database = argparse.ArgumentParser(add_help=False)
    database.add_argument("--database-url", help="default: $TULA_DATABASE_URL or sqlite:///var/tula.db")

    serve = sub.add_parser("serve", parents=[database], help="run the API server and its executor")
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

    submit = sub.add_parser("submit", parents=[client_options], help="submit a job spec (YAML or JSON)")
    submit.add_argument("spec")
    submit.add_argument("--wait", action="store_true", help="show progress and print the recommendation")
    submit.add_argument("--json", action="store_true", help="print JSON (the job, or with --wait the recommendation)")
    submit.add_argument("--idempotency-key", help="submitting again with this key returns the same job")
    submit.add_argument("--reference-stats", metavar="FILE",
                        help="gradient statistics of the reference run (JSONL of profiler.reference_logger, or a JSON list): "
                        "sent as training.reference_run.gradient_stats")
    submit.add_argument("--poll-s", type=positive_float, default=1.0)
    submit.add_argument("--timeout-s", type=positive_float, default=None)
    submit.set_defaults(func=_submit)

    status = sub.add_parser("status", parents=[client_options], help="list jobs, newest first")
    status.add_argument("--state", action="append", choices=JOB_STATES, help="only jobs in this state (repeatable)")
    status.add_argument("--limit", type=positive_int, default=50)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_status)

    show = sub.add_parser("show", parents=[client_options], help="a job, its points and its recommendation")
    show.add_argument("job_id")
    show.add_argument("--json", action="store_true", help='print {"job": ..., "recommendation": ...}')
    show.set_defaults(func=_show)

    plan = sub.add_parser("plan", parents=[client_options], help="re-plan a done job for another cluster, price, objective or reference run")
    plan.add_argument("job_id")
    plan.add_argument("--gpus", type=positive_int, help="total devices (nodes x the job's GPUs per node)")
    plan.add_argument("--nodes", type=positive_int)
    plan.add_argument("--gpus-per-node", type=positive_int)
    plan.add_argument("--gpu-type", help="GPU catalog name (`tula catalog gpus`)")
    plan.add_argument("--device-memory-gib", type=positive_float)
    plan.add_argument("--price", type=positive_float, help="USD per pricing unit")
    plan.add_argument("--pricing-kind", choices=get_args(PricingKind))
    plan.add_argument("--objective", choices=get_args(Objective))
    plan.add_argument("--deadline", dest="deadline_h", type=duration_h, metavar="DURATION", help="4h, 90m, 2.5h, 1d, 3600s; a number is hours")
    plan.add_argument("--budget", type=positive_float, help="USD")
    plan.add_argument("--reference-epochs", type=positive_float, help="epochs the reference run needs (re-anchors E(B))")
    plan.add_argument("--reference-lr", type=positive_float, help="learning rate of the reference run")
    plan.add_argument("--max-lr", type=positive_float, help="largest learning rate the model trains stably with")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)

    for name, helptext, func in (("cancel", "cancel a queued or running job", _cancel),
                                 ("delete", "delete a job and its measurements", _delete)):  # fmt: skip
        command = sub.add_parser(name, parents=[client_options], help=helptext)
        command.add_argument("job_id")
        command.set_defaults(func=func)

    catalog = sub.add_parser("catalog", parents=[client_options], help="list the models, datasets or GPUs the server knows")
    catalog.add_argument("kind", choices=CATALOG_KINDS)
    catalog.add_argument("--json", action="store_true")
    catalog.set_defaults(func=_catalog)

    token = sub.add_parser("token", help="create, list or revoke API tokens (on the database)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", parents=[database], help="create a token; it is printed once")
    create.add_argument("--name", required=True, help="1-100 of A-Z a-z 0-9 . _ -")
    create.set_defaults(func=_token_create)
    listing = token_sub.add_parser("list", parents=[database], help="every token, never the token itself")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_token_list)
    revoke = token_sub.add_parser("revoke", parents=[database], help="revoke tokens by name or prefix")
    revoke.add_argument("name_or_prefix")
    revoke.set_defaults(func=_token_revoke)
    return parser


def _server_url(args: argparse.Namespace) -> str:
    return getattr(args, "server", None) or environment().url


def _server_problem(error: TulaError, server: str) -> str:
    """`server answered 404: job 'x' not found`; a 422's bad fields one per line below."""
    if error.problem is None and error.message.lstrip().startswith("<"):  # another web server's page
        return f"server answered {error.status_code} with an HTML page, not the Tula API's JSON: is {server} a Tula server?"
    if error.problem is None:  # a proxy's plain-text answer
        return f"server answered {error.status_code}: {_one_line(error.message, 160)}"
    first, *fields = error.message.splitlines()
    return "\n".join([f"server answered {error.status_code}: {first}", *(f"  {line}" for line in fields)])


def _run(args: argparse.Namespace) -> int:
    """The command; every mistake a user can make ends as `error: ...` on stderr and EXIT_MISTAKE."""
    try:
        return args.func(args)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
    except TulaError as error:
        print(f"error: {_server_problem(error, _server_url(args))}", file=sys.stderr)
        if error.status_code == 401:
            print(f"hint: {TOKEN_HINT}", file=sys.stderr)
    except httpx.UnsupportedProtocol as error:
        print(f"error: the server URL '{_server_url(args)}' (--server, $TULA_URL) is not http:// or https:// ({error})", file=sys.stderr)
    except httpx.InvalidURL as error:
        print(f"error: the server URL '{_server_url(args)}' (--server, $TULA_URL) is not a valid URL ({error})", file=sys.stderr)
    except httpx.TransportError as error:  # connection refused, timeouts (after the client's retries)
        print(f"error: cannot reach the Tula server at {_server_url(args)}: {error}", file=sys.stderr)
    except httpx.HTTPError as error:  # too many redirects, a body that does not decode
        print(f"error: talking to the Tula server at {_server_url(args)} failed: {error}", file=sys.stderr)
    except json.JSONDecodeError as error:  # a 2xx that is not JSON: another web server
        print(f"error: {_server_url(args)} did not answer as a Tula server does (not JSON: {error})", file=sys.stderr)
    except ValidationError as error:  # JSON of another shape (a spec's mistakes are named before sending)
        if "server" not in vars(args):
            raise
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:5]]
        print(f"error: {_server_url(args)} did not answer as a Tula server does:\n" + "\n".join(lines), file=sys.stderr)
    except ArgumentError as error:  # also an unknown driver (NoSuchModuleError)
        print(f"error: not a database URL (--database-url, $TULA_DATABASE_URL): {error}", file=sys.stderr)
    except SQLAlchemyError as error:
        print(f"error: cannot use the database: {_one_line(str(getattr(error, 'orig', None) or error), 200)}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())

"""The client side of `tula`: submit, status, show, plan, cancel, delete and catalog, each a request
to a server through `tula_service.client.TulaClient`, with `--server` (default $TULA_URL) and
`--token` (default $TULA_TOKEN).

No database here, and nothing of the server: this module imports neither SQLAlchemy nor uvicorn nor
the app. `tula_service.client` and `tula_service.store.db` (the job states) still import SQLAlchemy
today, so they are imported where a command or the parser needs them, not with the module.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import httpx
from pydantic import ValidationError

from tula_service.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_JOB_NOT_DONE,
    EXIT_WAIT_TIMEOUT,
    CliError,
    one_line,
    positive_float,
    positive_int,
)  # fmt: skip
from tula_service.cli.human import human_number
from tula_service.cli.printing import (
    ProgressPrinter,
    compare_with_stored,
    describe_job,
    describe_what_if,
    format_gpu_catalog,
    format_job_list,
    format_recommendation,
)  # fmt: skip
from tula_service.settings import environment
from tula_service.spec.job_spec import Objective, PricingKind

if TYPE_CHECKING:
    from tula_service.client import TulaClient, TulaError
    from tula_service.schemas import JobView

HOURS_PER_UNIT = {"": 1.0, "s": 1 / 3600, "sec": 1 / 3600, "m": 1 / 60, "min": 1 / 60, "h": 1.0, "hr": 1.0, "d": 24.0}
TOKEN_HINT = "pass the API token with --token TOKEN or in the TULA_TOKEN environment variable"

Command = Callable[[argparse.Namespace], int]


def duration_h(text: str) -> float:
    """`4h`, `90m`, `2.5h`, `1d`, `3600s`; a bare number is hours."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in HOURS_PER_UNIT:
        raise argparse.ArgumentTypeError(f"'{text}' is not a duration: use e.g. 4h, 90m, 2.5h, 1d, 3600s or hours")
    hours = float(match.group(1)) * HOURS_PER_UNIT[match.group(2)]
    if hours <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive duration")
    return hours


def run_result(text: str) -> dict[str, Any]:
    """`256:14.5`: epochs to the same target measured at a global batch, as one of training.other_runs."""
    batch, _, epochs = text.partition(":")
    try:
        run = {"batch": positive_int(batch.strip()), "epochs": positive_float(epochs.strip())}
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"'{text}' is not BATCH:EPOCHS (a whole batch >= 1, epochs > 0), e.g. 256:14.5") from None
    return run


# --- talking to the server: its refusals and failures as one CliError each ---------------------------


def _server_url(args: argparse.Namespace) -> str:
    return args.server or environment().url


def _server_problem(error: TulaError, server: str) -> str:
    """`server answered 404: job 'x' not found`; a 422's bad fields one per line below."""
    if error.problem is None and error.message.lstrip().startswith("<"):  # another web server's page
        return f"server answered {error.status_code} with an HTML page, not the Tula API's JSON: is {server} a Tula server?"
    if error.problem is None:  # a proxy's plain-text answer
        return f"server answered {error.status_code}: {one_line(error.message, 160)}"
    first, *fields = error.message.splitlines()
    return "\n".join([f"server answered {error.status_code}: {first}", *(f"  {line}" for line in fields)])


def talks_to_the_server(command: Command) -> Command:
    """The command, with what can go wrong between it and the server as a CliError: a refusal (a
    401 adds how to pass the token), a bad --server URL, a server that cannot be reached or answers
    as no Tula server does."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from tula_service.client import TulaError

        try:
            return command(args)
        except TulaError as error:
            hint = f"\nhint: {TOKEN_HINT}" if error.status_code == 401 else ""
            raise CliError(_server_problem(error, _server_url(args)) + hint) from None
        except httpx.UnsupportedProtocol as error:
            raise CliError(f"the server URL '{_server_url(args)}' (--server, $TULA_URL) is not http:// or https:// ({error})") from None
        except httpx.InvalidURL as error:
            raise CliError(f"the server URL '{_server_url(args)}' (--server, $TULA_URL) is not a valid URL ({error})") from None
        except httpx.TransportError as error:  # connection refused, timeouts (after the client's retries)
            raise CliError(f"cannot reach the Tula server at {_server_url(args)}: {error}") from None
        except httpx.HTTPError as error:  # too many redirects, a body that does not decode
            raise CliError(f"talking to the Tula server at {_server_url(args)} failed: {error}") from None
        except json.JSONDecodeError as error:  # a 2xx that is not JSON: another web server
            raise CliError(f"{_server_url(args)} did not answer as a Tula server does (not JSON: {error})") from None
        except ValidationError as error:  # JSON of another shape (a spec's mistakes are named before sending)
            lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:5]]
            raise CliError(f"{_server_url(args)} did not answer as a Tula server does:\n" + "\n".join(lines)) from None

    return run


def _client(args: argparse.Namespace) -> TulaClient:
    from tula_service.client import TulaClient

    return TulaClient(args.server, token=args.token)


# --- the spec file and the reference run's gradient statistics ---------------------------------------


def _reference_stats(path: str) -> list[dict[str, Any]]:
    """The records of `--reference-stats FILE` (JSONL or a JSON list), each checked."""
    from tula_service.fit.gradient_stats_file import coarsen_records, read_gradient_stats
    from tula_service.spec.job_spec import MAX_GRADIENT_STATS_RECORDS
    from tula_service.spec.specfile import FileRefused

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
    validated here, so a mistake is named before anything is sent. What the server decides by its own
    configuration (the allowlist of user code, the data roots, its bounds) and the user code's contract are
    left to the server's 422 (JobSpec.checked_by_client)."""
    from tula_service.spec.job_spec import JobSpec  # the catalogs behind it take a second to import
    from tula_service.spec.specfile import load_spec_file

    try:
        data = load_spec_file(path)
        if reference_stats is not None:
            with_reference_stats(data, _reference_stats(reference_stats))
        JobSpec.checked_by_client(data)  # fail here, naming the field, before anything is sent; the server's policy is its own
    except OSError as error:
        raise CliError(f"cannot read spec {path}: {error.strerror}") from None
    except ValidationError as error:
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()]
        raise CliError(f"{path} is not a valid job spec:\n" + "\n".join(lines)) from None
    except ValueError as error:
        raise CliError(str(error)) from None
    return data


# --- the what-if of `tula plan` ----------------------------------------------------------------------


def _node_split(gpus: int, gpus_per_node: int) -> str:
    per_node = max(d for d in range(1, gpus_per_node + 1) if gpus % d == 0)
    return f"--nodes {gpus // per_node} --gpus-per-node {per_node}"


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_what_if(args: argparse.Namespace, spec: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The what-if body for `tula plan` and, in words, what it changes in the job's stored spec and
    which given values the spec has already. Whether the what-if fits the stored spec (objective
    'deadline' needs deadline_h, max_lr needs reference_lr, ...) is the server's to say: the spec's
    own rules, as a 409 naming the field."""
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
                                              ("max_lr", args.max_lr), ("other_runs", args.other_runs)) if value is not None}  # fmt: skip

    # --deadline alone means the deadline objective, --budget alone the budget one; both is ambiguous.
    objective = args.objective
    if objective is None and (args.deadline_h is not None or args.budget is not None):
        if args.deadline_h is not None and args.budget is not None:
            raise CliError("--deadline and --budget given: say which one counts with --objective deadline|budget")
        objective = "deadline" if args.deadline_h is not None else "budget"

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
    if args.reference_stats is not None:  # a list of records: named by its count, not compared field by field
        records = _reference_stats(args.reference_stats)
        stored = len(((spec.get("training") or {}).get("reference_run") or {}).get("gradient_stats") or [])
        what_if.setdefault("training", {})["reference_run"] = {"gradient_stats": records}
        changes.append(f"training.reference_run.gradient_stats {stored} records -> {len(records)} from {args.reference_stats}")
    for key, value in (("objective", objective), ("deadline_h", args.deadline_h), ("budget_usd", args.budget)):
        if value is not None:
            what_if[key] = value
            compare(key, spec.get(key), value)
    return what_if, changes, unchanged


# --- the commands ------------------------------------------------------------------------------------


@talks_to_the_server
def _submit(args: argparse.Namespace) -> int:
    if args.profile is not None and not args.measurements:
        raise CliError("--profile chooses what to profile beyond --measurements: give --measurements FILE")
    spec = _validated_spec(args.spec, args.reference_stats)
    # With --json, stdout is one JSON document; the narration goes to stderr.
    narration = sys.stderr if args.json else sys.stdout
    if args.reference_stats:
        records = spec["training"]["reference_run"]["gradient_stats"]
        print(f"reference run: {len(records)} gradient-statistics records from {args.reference_stats}", file=narration, flush=True)
    with _client(args) as client:
        if args.measurements:
            records, csv_text = _measurement_files(args.measurements)
            job = client.submit_with_measurements(spec, records, csv_text, args.profile or "missing", args.idempotency_key)
            to_profile = job.progress.points_total - job.progress.points_done
            print(f"submitted job {job.id} from measurements: {job.progress.points_done} supplied, {to_profile} points to profile"
                  + (f" ({job.state})" if job.state == "done" else ""), file=narration, flush=True)  # fmt: skip
        else:
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


@talks_to_the_server
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
    print(format_job_list(jobs))
    if total > len(jobs):
        print(f"({len(jobs)} of {total} jobs shown; --limit for more)")
    return 0


@talks_to_the_server
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


WHAT_IF_FLAGS = ("gpus", "nodes", "gpus_per_node", "gpu_type", "device_memory_gib", "price", "pricing_kind", "objective",
                 "deadline_h", "budget", "reference_epochs", "reference_lr", "max_lr", "other_runs")  # fmt: skip


def _measurement_files(paths: list[str]) -> tuple[list[dict[str, Any]], str | None]:
    """The records of --measurements files: a CSV table of steps (at most one; the server reads its rows),
    JSONL (a record a line), or JSON (a list of records, or GET /v1/jobs/{id}/measurements's answer)."""
    records, csv_text = [], None
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise CliError(f"cannot read measurements {path}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise CliError(f"{path} is not text: measurements are JSON, JSONL or CSV") from None
        if path.lower().endswith(".csv"):
            if csv_text is not None:
                raise CliError("give at most one CSV of steps (--measurements); the other measurements as JSON or JSONL")
            csv_text = text
            continue
        records += _json_records(path, text)
    return records, csv_text


def _parsed_json(path: str, text: str, line_number: int | None = None) -> Any:
    """`text` parsed; a mistake names its line in the file (`line_number` for one line of JSONL)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        line = line_number or error.lineno
        raise CliError(f"{path}: not valid JSON at line {line}, column {error.colno}: {error.msg}") from None


def _json_records(path: str, text: str) -> list[dict[str, Any]]:
    """A JSON list of records, or JSONL (one a line)."""
    if path.lower().endswith(".jsonl"):
        loaded = [_parsed_json(path, line, number) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    else:
        loaded = _parsed_json(path, text)
    if isinstance(loaded, dict) and isinstance(loaded.get("points"), list):  # GET /v1/jobs/{id}/measurements
        loaded = [point["measurement"] for point in loaded["points"] if isinstance(point, dict) and point.get("measurement")]
    if not isinstance(loaded, list) or not all(isinstance(record, dict) for record in loaded):
        raise CliError(f"{path}: expected a list of measurement records (objects), one per line in JSONL")
    return loaded


@talks_to_the_server
def _plan_measurements(args: argparse.Namespace) -> int:
    """`tula plan --spec FILE --measurements FILE ...`: POST /v1/plan, nothing stored."""
    given = [flag for flag in WHAT_IF_FLAGS if getattr(args, flag) is not None]
    if args.job_id or not args.spec or given:
        raise CliError("tula plan --measurements plans a spec file: give --spec FILE and no job id"
                       + (f" (and edit the spec rather than --{given[0].replace('_', '-')})" if given else ""))  # fmt: skip
    spec = _validated_spec(args.spec, args.reference_stats)
    records, csv_text = _measurement_files(args.measurements)
    with _client(args) as client:
        result = client.plan_measurements(spec, records, csv_text)
    print(json.dumps(result, indent=2) if args.json else format_recommendation(result))
    return 0


@talks_to_the_server
def _plan(args: argparse.Namespace) -> int:
    if args.measurements:
        return _plan_measurements(args)
    if not args.job_id:
        raise CliError("tula plan needs a job id (a what-if of a done job) or --spec FILE --measurements FILE")
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
    print(compare_with_stored(before, result))
    return 0


@talks_to_the_server
def _cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job_id)
    measured = job.progress.points_measured
    print(f"job {job.id}: {job.state} ({measured} of {job.progress.points_total} points measured"
          + (")" if measured else "; nothing was measured)"))
    return 0


@talks_to_the_server
def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete(args.job_id)
    print(f"deleted job {args.job_id}")
    return 0


@talks_to_the_server
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
    if args.kind == "losses":
        for entry in listing["losses"]:
            default = " (default)" if entry["name"] == listing.get("default") else ""
            print(f"{entry['name']:<16} targets {entry['targets']:<13} {entry['description']}{default}")
        print("\na catalog dataset of float targets trains with its own default loss (`tula catalog datasets`: loss=...)")
        allowed = listing["user_losses"]["allowed_module_prefixes"]
        print(f"\nuser losses 'module:function': allowed prefixes {allowed or 'none'} (server env {listing['user_losses']['env']})")
        return 0
    for entry in listing[args.kind]:
        extras = dict(entry.get("options") or entry.get("fields") or {})
        if entry.get("targets", "labels") != "labels":  # a regression dataset: what it trains with by default
            extras |= {"targets": entry["targets"], "loss": entry.get("default_loss")}
        settings = ", ".join(f"{k}={human_number(v) if isinstance(v, float) else v}" for k, v in extras.items())
        print(f"{entry['name']:<22} {entry['input_kind']:<9} {settings}".rstrip())
    if args.kind == "models":
        allowed = listing["user_models"]["allowed_module_prefixes"]
        print(f"\nuser models 'module:factory': allowed prefixes {allowed or 'none'} (server env {listing['user_models']['env']})")
    return 0


# --- their arguments ---------------------------------------------------------------------------------


def client_options_parser() -> argparse.ArgumentParser:
    """--server and --token, the parent parser of every command that talks to a server."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--server", help="API base URL (default: $TULA_URL or http://127.0.0.1:8000)")
    options.add_argument("--token", help="API token (default: $TULA_TOKEN)")
    return options


def add_commands(sub: argparse._SubParsersAction) -> None:
    from tula_service.client import CATALOG_KINDS
    from tula_service.store.states import JOB_STATES

    client_options = client_options_parser()

    submit = sub.add_parser("submit", parents=[client_options], help="submit a job spec (YAML or JSON)")
    submit.add_argument("spec")
    submit.add_argument("--wait", action="store_true", help="show progress and print the recommendation")
    submit.add_argument("--json", action="store_true", help="print JSON (the job, or with --wait the recommendation)")
    submit.add_argument("--idempotency-key", help="submitting again with this key returns the same job")
    submit.add_argument("--reference-stats", metavar="FILE",
                        help="gradient statistics of the reference run (JSONL of profiler.reference_logger, or a JSON list): "
                        "sent as training.reference_run.gradient_stats")
    submit.add_argument("--measurements", metavar="FILE", action="append",
                        help="measurements taken anywhere to start the job from (repeatable; JSON, JSONL or a CSV of steps, "
                        "as for tula plan): POST /v1/jobs/from-measurements profiles only what they miss")
    submit.add_argument("--profile", choices=("missing", "none"),
                        help="with --measurements: profile what they miss (default), or nothing")
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

    plan = sub.add_parser("plan", parents=[client_options], help="re-plan a done job for another cluster, price, objective or "
                          "reference run; or plan a spec from measurements taken anywhere (--spec, --measurements)")
    plan.add_argument("job_id", nargs="?")
    plan.add_argument("--spec", metavar="FILE", help="with --measurements: the job spec (YAML or JSON) to plan")
    plan.add_argument("--measurements", metavar="FILE", action="append",
                      help="measurements to plan --spec from, nothing stored (repeatable): JSON or JSONL Measurement records, "
                      "or a CSV of steps with the header placement,local_bsz,step_time,sync_time or "
                      "num_nodes,num_replicas,local_bsz,step_time,sync_time")
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
    plan.add_argument("--reference-stats", metavar="FILE",
                      help="gradient statistics of the reference run (JSONL of profiler.reference_logger, or a JSON list): "
                      "they replace training.reference_run.gradient_stats, of the job or of --spec")
    plan.add_argument("--other-run", dest="other_runs", action="append", type=run_result, metavar="BATCH:EPOCHS",
                      help="epochs to the same target measured at another global batch (repeatable; replaces "
                      "training.other_runs): E_min and B_noise are fitted to the runs, the noise scale read as their prior")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)

    for name, helptext, func in (("cancel", "cancel a queued or running job", _cancel),
                                 ("delete", "delete a job and its measurements", _delete)):  # fmt: skip
        command = sub.add_parser(name, parents=[client_options], help=helptext)
        command.add_argument("job_id")
        command.set_defaults(func=func)

    catalog = sub.add_parser("catalog", parents=[client_options], help="list the models, datasets, losses or GPUs the server knows")
    catalog.add_argument("kind", choices=CATALOG_KINDS)
    catalog.add_argument("--json", action="store_true")
    catalog.set_defaults(func=_catalog)

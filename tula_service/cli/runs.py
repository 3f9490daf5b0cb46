"""`tula run ...`: a training run of a done job, from a shell (issue 17).

    tula run start JOB_ID [--hysteresis 0.05] [--min-steps-between-changes 100]   # prints the run id and its config
    tula run show RUN_ID                                                         # config, records, decisions
    tula run plan RUN_ID                                                         # the advice for the next interval
    tula run upload RUN_ID telemetry.jsonl                                       # a TulaRun offline file, sent

`upload` is for a loop that ran with `TulaRun(server=None, offline_path=...)` (no route to the server from the
cluster, say): every line is checked as a TelemetryRecord before anything is sent, a mistake named by its line
and field, and the records go in posts of the server's bound; a step the run holds already is a duplicate, so a
file sent twice, or after the live sender sent part of it, is stored once. Each command prints JSON with --json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from tula_service.cli.client import _client, client_options_parser, talks_to_the_server
from tula_service.cli.common import CliError, one_line

MAX_PROBLEMS_SHOWN = 20


def read_telemetry_file(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL file (one TelemetryRecord a line; blank lines skipped), each checked; a CliError naming
    the line and field of every mistake (the first MAX_PROBLEMS_SHOWN)."""
    from tula_service.runs.telemetry import MAX_RECORDS_PER_RUN, TelemetryRecord

    try:
        with open(path, encoding="utf-8") as lines:
            numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    except OSError as error:
        raise CliError(f"cannot read telemetry {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise CliError(f"{path} is not a text file of JSON lines ({error.reason})") from None
    records, problems = [], []
    for number, line in numbered:
        try:
            record = json.loads(line.strip())
            records.append(TelemetryRecord.model_validate(record).model_dump(mode="json", exclude_none=True))
        except json.JSONDecodeError as error:
            problems.append(f"line {number}: not JSON ({error.msg}, column {error.colno})")
        except ValidationError as error:
            problems += [f"line {number}: {'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}" for e in error.errors()]
    if problems:
        shown = "\n".join(f"  {problem}" for problem in problems[:MAX_PROBLEMS_SHOWN])
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        raise CliError(f"{path} is not a telemetry file (one TelemetryRecord a line):\n{shown}{more}")
    if not records:
        raise CliError(f"{path} holds no telemetry records")
    if len(records) > MAX_RECORDS_PER_RUN:  # the server would refuse the posts past it, having stored those before
        raise CliError(f"{path} holds {len(records)} telemetry records; a run holds at most {MAX_RECORDS_PER_RUN}")
    return records


def describe_config(config: dict[str, Any]) -> str:
    """`global batch 128 (device batch 64 x accumulation 2 on placement [1]), LR 0.1 (predicted; x2 the reference, fitted),
    since step 200`. The LR and its multiplier come labelled ({"value", "source"}), as every number the server returns."""
    lr, multiplier = _labelled(config.get("lr")), _labelled(config.get("lr_multiplier"))
    text = (f"global batch {config.get('global_batch')} (device batch {config.get('device_batch')} x accumulation "
            f"{config.get('accumulation')} on placement {config.get('placement')})")  # fmt: skip
    if lr is not None:
        told = [f"x{multiplier[0]:.3g} the reference" + (f", {multiplier[1]}" if multiplier[1] else "")] if multiplier else []
        told = ([lr[1]] if lr[1] else []) + told
        text += f", LR {lr[0]:.4g}" + (f" ({'; '.join(told)})" if told else "")
    return text + (f", since step {config['since_step']}" if config.get("since_step") else "")


def _labelled(quantity: Any) -> tuple[float, str | None] | None:
    """(value, source) of a number the server labels ({"value": 0.1, "source": "predicted"}), or of a bare one."""
    if isinstance(quantity, dict):
        value = quantity.get("value")
        return (float(value), quantity.get("source")) if isinstance(value, (int, float)) else None
    return (float(quantity), None) if isinstance(quantity, (int, float)) and not isinstance(quantity, bool) else None


def describe_run(run: dict[str, Any]) -> str:
    last = "" if run.get("last_step") is None else f", last step {run['last_step']}"
    lines = [f"run {run['id']} of job {run['job_id']}: {run['records']} telemetry records{last}",
             f"  train with: {describe_config(run['config'])} ({run['config'].get('source')})"]  # fmt: skip
    for decision in run.get("decisions") or []:
        before, after = decision.get("from") or {}, decision.get("to") or {}
        lines.append(f"  step {decision.get('step')}: global batch {before.get('global_batch')} -> {after.get('global_batch')}: "
                     f"{one_line(decision.get('why'), 160)}")  # fmt: skip
    return "\n".join(lines)


def describe_plan(plan: dict[str, Any]) -> str:
    lines = [f"run {plan['run_id']} at step {plan.get('step')}: " + ("CHANGED, " if plan.get("changed") else "")
             + f"train with {describe_config(plan['config'])}", f"  why: {plan['why']}"]  # fmt: skip
    noise = (plan.get("evidence") or {}).get("noise_scale")
    if isinstance(noise, dict) and noise.get("value") is not None:
        why = plan["evidence"].get("noise_scale_why")
        lines.append(f"  noise scale {noise['value']:.4g} ({noise.get('source', 'fitted')}) from {plan['evidence'].get('noise_scale_from', '-')}"
                     + (f": {why}" if why else ""))  # fmt: skip
    return "\n".join(lines)


@talks_to_the_server
def _start(args: argparse.Namespace) -> int:
    from tula_service.runs.telemetry import RunRequest

    options = {key: value for key, value in (("hysteresis", args.hysteresis), ("min_steps_between_changes", args.min_steps_between_changes))
               if value is not None}  # fmt: skip
    try:  # the server's contract, checked before anything is sent
        RunRequest.model_validate({"job_id": args.job_id, **options})
    except ValidationError as error:
        lines = [f"  --{'.'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in error.errors()]
        raise CliError("not a run the server would start:\n" + "\n".join(lines)) from None
    with _client(args) as client:
        run = client.start_run(args.job_id, options, args.idempotency_key)
    print(json.dumps(run, indent=2) if args.json else f"started run {run['id']}\n" + describe_run(run))
    return 0


def _printed(fetch: str, describe: Callable[[dict[str, Any]], str]) -> Callable[[argparse.Namespace], int]:
    """A command that prints the client's `fetch(run_id)` answer, described or as JSON."""

    @talks_to_the_server
    def command(args: argparse.Namespace) -> int:
        with _client(args) as client:
            answer = getattr(client, fetch)(args.run_id)
        print(json.dumps(answer, indent=2) if args.json else describe(answer))
        return 0

    return command


_show, _plan = _printed("run", describe_run), _printed("run_plan", describe_plan)


@talks_to_the_server
def _upload(args: argparse.Namespace) -> int:
    records = read_telemetry_file(args.file)
    with _client(args) as client:
        totals = client.upload_telemetry(args.run_id, records)
        run = client.run(args.run_id)
    if args.json:
        print(json.dumps({**totals, "records": run["records"], "last_step": run["last_step"]}, indent=2))
    else:
        print(f"run {args.run_id}: {totals['accepted']} records stored, {totals['duplicates']} it held already "
              f"({totals['posts']} posts); it holds {run['records']}, last step {run['last_step']}")  # fmt: skip
    return 0


def add_run(sub: argparse._SubParsersAction) -> None:
    options = client_options_parser()
    run = sub.add_parser("run", help="a training run of a done job: start it, show it, ask its plan, upload its telemetry")
    commands = run.add_subparsers(dest="run_command", required=True)
    start = commands.add_parser("start", parents=[options], help="start a run at a done job's recommended configuration")
    start.add_argument("job_id")
    start.add_argument("--hysteresis", type=float, help="the share of the run's time a change must save, 0-1 (default 0.05)")
    start.add_argument("--min-steps-between-changes", type=int, help="the rate limit on changes, in steps (default 100)")
    start.add_argument("--idempotency-key", help="a retry with the same key returns the same run")
    start.add_argument("--json", action="store_true")
    start.set_defaults(func=_start)
    for name, helptext, func in (("show", "a run: its configuration, records and decisions", _show),
                                 ("plan", "the run's advice for its next interval, re-planned from its telemetry", _plan)):  # fmt: skip
        command = commands.add_parser(name, parents=[options], help=helptext)
        command.add_argument("run_id")
        command.add_argument("--json", action="store_true")
        command.set_defaults(func=func)
    upload = commands.add_parser("upload", parents=[options], help="send a TulaRun offline JSONL file to the run")
    upload.add_argument("run_id")
    upload.add_argument("file", help="JSONL, one telemetry record a line (TulaRun(server=None, offline_path=FILE))")
    upload.add_argument("--json", action="store_true")
    upload.set_defaults(func=_upload)

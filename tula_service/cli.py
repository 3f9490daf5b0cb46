"""`tula`: serve the API, submit a spec (and wait for it), show a job's recommendation."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from tula_service.client import TulaClient, TulaError
from tula_service.spec import JobSpec
from tula_service.specfile import load_spec_file

GIB = 2**30


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tula_service.api import Settings, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(
        database_url=args.database_url,
        executor=args.executor,
        workers=args.workers,
        seed_example=Path(args.seed_example) if args.seed_example else None,
    )
    app = create_app(settings)
    base = f"http://{args.host}:{args.port}"
    print(f"Tula API:       {base}/v1/jobs", flush=True)
    print(f"API docs:       {base}/docs", flush=True)
    print(f"Database:       {args.database_url}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _validated_spec(path: str) -> dict[str, Any]:
    try:
        data = load_spec_file(path)
        JobSpec.model_validate(data)  # fail here, naming the field, before anything is sent
    except OSError as error:
        raise SystemExit(f"error: cannot read spec {path}: {error.strerror}") from None
    except ValidationError as error:
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()]
        raise SystemExit(f"error: {path} is not a valid job spec:\n" + "\n".join(lines)) from None
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return data


class ProgressPrinter:
    """A live bar on a terminal; one line per change otherwise (logs, CI)."""

    def __init__(self, stream=sys.stdout, width: int = 30):
        self.stream = stream
        self.width = width
        self._last: tuple | None = None

    def __call__(self, job: dict[str, Any]) -> None:
        done, total = job["progress"]["points_done"], job["progress"]["points_total"]
        if (done, job["state"]) == self._last:
            return
        self._last = (done, job["state"])
        filled = int(self.width * done / total) if total else self.width
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} points  {job['state']:<10}"
        if self.stream.isatty():
            print(f"\r{line}", end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.stream.isatty():
            print(file=self.stream)


def format_recommendation(rec: dict[str, Any]) -> str:
    chosen = rec["chosen"]
    lines = [
        f"objective: {rec['objective']}"
        + (f"  (knee by {rec['knee']['method']}, S={rec['knee']['sensitivity']}, on {rec['knee']['curve']})" if rec.get("knee") else ""),
        f"chosen: global batch {chosen['global_batch']} = device batch {chosen['device_batch']}"
        f" x {chosen['devices']} devices x {chosen['accumulation']} accumulation",
        f"  predicted total time {chosen['total_time_s']['value'] / 3600:.3f} h,"
        f" cost ${chosen['cost_usd']['value']:.2f}, memory {chosen['memory_bytes']['value'] / GIB:.3f} GiB"
        f" ({chosen['memory_bytes']['source']}), epochs {chosen['epochs']['value']:.2f} ({chosen['epochs']['source']})",
    ]
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
    lines += [
        "",
        f"{'batch':>7} {'dev_b':>6} {'dev':>4} {'acc':>4} {'mem GiB':>9} {'iter s':>9} {'total h':>9} {'cost $':>9} pareto",
    ]
    front = [c for c in rec["candidates"] if c["pareto"]]
    for c in sorted(front, key=lambda c: c["global_batch"]):
        lines.append(
            f"{c['global_batch']:>7} {c['device_batch']:>6} {c['devices']:>4} {c['accumulation']:>4}"
            f" {c['memory_bytes']['value'] / GIB:>9.3f} {c['iter_time_s']['value']:>9.4f}"
            f" {c['total_time_s']['value'] / 3600:>9.3f} {c['cost_usd']['value']:>9.2f}   *"
        )
    lines.append(f"({len(rec['candidates'])} candidates in all; Pareto front shown; --json for everything)")
    return "\n".join(lines)


def _submit(args: argparse.Namespace) -> int:
    spec = _validated_spec(args.spec)
    with TulaClient(args.server) as client:
        job = client.submit(spec)
        print(f"submitted job {job['id']} ({job['progress']['points_total']} points)", flush=True)
        if not args.wait:
            return 0
        progress = ProgressPrinter()
        job = client.wait(job["id"], poll_s=args.poll_s, timeout_s=args.timeout_s, on_progress=progress)
        progress.close()
        if job["state"] == "failed":
            print(f"job {job['id']} failed: {job['error']}", file=sys.stderr)
            return 1
        rec = client.recommendation(job["id"])
        print(json.dumps(rec, indent=2) if args.json else format_recommendation(rec))
    return 0


def _show(args: argparse.Namespace) -> int:
    with TulaClient(args.server) as client:
        job = client.job(args.job_id)
        if job["state"] != "done":
            print(json.dumps(job, indent=2) if args.json else f"job {job['id']}: {job['state']}"
                  f" ({job['progress']['points_done']}/{job['progress']['points_total']} points)"
                  + (f"\nerror: {job['error']}" if job.get("error") else ""))
            return 1 if job["state"] == "failed" else 0
        rec = client.recommendation(args.job_id)
        print(json.dumps(rec, indent=2) if args.json else f"job {job['id']}: done\n" + format_recommendation(rec))
    return 0


def _catalog(args: argparse.Namespace) -> int:
    with TulaClient(args.server) as client:
        listing = client.catalog(args.kind)
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for entry in listing[args.kind]:
        extras = entry.get("options") or entry.get("fields") or {}
        settings = ", ".join(f"{k}={v}" for k, v in extras.items())
        print(f"{entry['name']:<22} {entry['input_kind']:<9} {settings}")
    if args.kind == "models":
        allowed = listing["user_models"]["allowed_module_prefixes"]
        print(f"\nuser models 'module:factory': allowed prefixes {allowed or 'none'} (server env {listing['user_models']['env']})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tula", description="Tula batch-size optimizer")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the API server and the local executor")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--database-url", default="sqlite:///var/tula.db")
    serve.add_argument("--executor", default="local", choices=["local"])
    serve.add_argument("--workers", type=int, default=1, help="profiling points run at once")
    serve.add_argument("--seed-example", help="spec file submitted when the database is empty")
    serve.set_defaults(func=_serve)

    catalog = sub.add_parser("catalog", help="list the models or datasets the server knows")
    catalog.add_argument("kind", choices=["models", "datasets"])
    catalog.add_argument("--server", help="API base URL (default: $TULA_URL or http://127.0.0.1:8000)")
    catalog.add_argument("--json", action="store_true")
    catalog.set_defaults(func=_catalog)

    for name, helptext, func in (("submit", "submit a job spec (YAML or JSON)", _submit), ("show", "show a job and its recommendation", _show)):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--server", help="API base URL (default: $TULA_URL or http://127.0.0.1:8000)")
        command.add_argument("--json", action="store_true", help="print the full JSON")
        command.set_defaults(func=func)
        if name == "submit":
            command.add_argument("spec")
            command.add_argument("--wait", action="store_true", help="show progress and print the recommendation")
            command.add_argument("--poll-s", type=float, default=1.0)
            command.add_argument("--timeout-s", type=float, default=None)
        else:
            command.add_argument("job_id")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TulaError as error:
        print(f"error: server answered {error.status_code}:\n{error}", file=sys.stderr)
        return 2
    except httpx.TransportError as error:  # connection refused, timeouts
        print(f"error: cannot reach the Tula server: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

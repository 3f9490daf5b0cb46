"""Child-process entry point: `python -m profiler.run_point --request JSON --out FILE`.

Writes one JSON measurement to FILE: a compute point (`profiler.measure.profile_point`), the pilot
(`profiler.pilot.run_pilot`) when the request's "kind" is "pilot", or a data-parallel step on this
host's devices (`profiler.ddp_step.measure_step`) when it is "step". Exit code 0 means FILE holds a
record: status "ok", "oom", or "failed" when the point itself raised (a bad dataset path, a model
that does not build), with the error and the traceback's tail; such a point would fail again, so it
is not retried. Any other exit (a signal, a crash before the record is written) means the worker
died, and the server retries. The warm worker (`profiler.warm_worker`) calls `main` with the same
arguments in a child it forked, so both ways of starting a point write the same record.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

TRACEBACK_TAIL_CHARS = 2000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiler.run_point")
    parser.add_argument("--request", required=True, help="profiling request as JSON")
    parser.add_argument("--out", required=True, type=Path, help="where to write the measurement JSON")
    args = parser.parse_args(argv)

    request = json.loads(args.request)
    kind = request.get("kind", "compute")
    if kind == "pilot":  # imports torch; after argument parsing
        from profiler.pilot import run_pilot as measure
    elif kind == "step":
        from profiler.ddp_step import measure_step as measure
    else:
        from profiler.measure import profile_point as measure
    try:
        measurement = measure(request)
    except Exception as error:  # noqa: BLE001 - the point's own failure is data, not a dead worker
        measurement = {
            "kind": kind,
            "status": "failed",
            "batch_size": request.get("batch_size"),
            "error": f"{type(error).__name__}: {error}",
            "traceback_tail": traceback.format_exc()[-TRACEBACK_TAIL_CHARS:],
        }
        if kind == "step":  # a step record names where it ran (tula_service.measurement.StepMeasurement)
            measurement |= {"placement": request.get("placement"), "device_batch": request.get("batch_size")}
    tmp = args.out.with_suffix(".partial")
    tmp.write_text(json.dumps(measurement))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

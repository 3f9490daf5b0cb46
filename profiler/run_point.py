"""Child-process entry point: `python -m profiler.run_point --request JSON --out FILE`.

Writes one JSON measurement to FILE. Exit code 0 means FILE holds a measurement (status "ok" or
"oom"); any other exit is a failed point and stderr says why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiler.run_point")
    parser.add_argument("--request", required=True, help="profiling request as JSON")
    parser.add_argument("--out", required=True, type=Path, help="where to write the measurement JSON")
    args = parser.parse_args(argv)

    from profiler.measure import profile_point  # imports torch; after argument parsing

    measurement = profile_point(json.loads(args.request))
    tmp = args.out.with_suffix(".partial")
    tmp.write_text(json.dumps(measurement))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

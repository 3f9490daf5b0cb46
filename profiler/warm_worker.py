"""The warm worker: one long-lived process per device that imports torch and the profiler once, then
forks a child per point (`python -m profiler.warm_worker`, started by the server's LocalExecutor).

A point started cold (`python -m profiler.run_point`) spends its first seconds starting Python and
importing torch (and torch._dynamo, which the first optimizer pulls in). Here that happens once; each
point's child is an `os.fork` of an already-imported process and runs exactly what the cold command
runs (`profiler.run_point.main` or `profiler.comm.main` with the same arguments), writing its record
to the same `--out FILE`. So every guarantee of the cold path holds:

- the child leads its own session (process group): the executor kills the group to cancel it or
  end a timeout, and the warm worker reports the exit like any other;
- the child dies with the warm worker (PR_SET_PDEATHSIG), and the warm worker with the executor
  thread that started it, so a killed server leaves no profiling running;
- a child that dies without a record is a died attempt; the executor retries it.

Fork safety: this process never runs a torch operation and never touches CUDA, so no OpenMP pool,
CUDA context or other thread of torch's exists to be copied half-made into a child (the child
initializes CUDA itself, on the device CUDA_VISIBLE_DEVICES gives this process). An all-reduce
child forks its gloo ranks in turn, under the same rule (`profiler.comm`), so they too start with
torch imported; they die with it, and are in its process group, so killing the point kills them.

Protocol, one JSON object per line. Parent -> worker on stdin:
    {"module": "profiler.run_point", "argv": [...], "stderr": "/path/to/stderr.txt"}
Worker -> parent on its original stdout (fd 1 itself is pointed at stderr): {"ready": true, "pid": PID, "preload_s": S} once the imports are done,
then per request {"started": CHILD_PID} and {"exited": CHILD_PID, "returncode": RC} (RC < 0: killed
by signal -RC, as in subprocess), or {"refused": REASON} for a module it does not run. One point
at a time; stdin closing ends the worker.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import time
import traceback

MODULES = ("profiler.run_point", "profiler.comm")  # what a child may run: the cold path's modules
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "models.workload", "profiler.measure", "profiler.pilot", "profiler.comm")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NAME = 15
CHILD_NAME = b"tula-point"


def preload() -> float:
    """Import what every point imports; returns the seconds it took."""
    started = time.perf_counter()
    for module in PRELOAD:
        importlib.import_module(module)
    return time.perf_counter() - started


def _prctl(option: int, value) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        pass


class _Protocol:
    """The reply pipe: the stdout this process was started with, moved off fd 1 so that anything an
    import prints goes to stderr instead of into the protocol."""

    def __init__(self):
        self.fd = os.dup(1)
        os.dup2(2, 1)
        self._stream = os.fdopen(self.fd, "w", buffering=1)

    def send(self, message: dict) -> None:
        self._stream.write(json.dumps(message) + "\n")
        self._stream.flush()


def _run_child(module: str, argv: list[str], stderr_path: str, worker_pid: int, protocol_fd: int) -> None:
    """In the forked child: become a session of its own, die with the worker, run the module's main."""
    code = 1
    try:
        os.setsid()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker_pid:  # the worker died before the death signal was armed
            os._exit(1)
        _prctl(PR_SET_NAME, ctypes.c_char_p(CHILD_NAME))
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        os.close(protocol_fd)  # the pipes are the worker's: its death must close them
        devnull = os.open(os.devnull, os.O_RDWR)
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(err, 2)
        os.close(devnull)
        os.close(err)
        sys.argv = [f"-m {module}", *argv]
        code = importlib.import_module(module).main(argv) or 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash of the child is its exit code, like a cold child's
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    protocol = _Protocol()
    preload_s = preload()
    worker_pid = os.getpid()
    protocol.send({"ready": True, "pid": worker_pid, "preload_s": preload_s})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        module = request.get("module")
        if module not in MODULES:
            protocol.send({"refused": f"module '{module}' is not run by the warm worker; known: {', '.join(MODULES)}"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(module, list(request["argv"]), request["stderr"], worker_pid, protocol.fd)
        protocol.send({"started": pid})
        _, status = os.waitpid(pid, 0)
        protocol.send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(serve())

"""The submit-time check of user code (docs/user_models.md), without importing torch in the server.

A job spec that names a "package.module:factory" model or dataset is checked when it is validated: a child
process of the server's own Python (`python -m models.user_contract --check-file FILE --out FILE`, in the
server's working directory and environment, as a profiling worker runs) imports the user code, builds the
dataset and the model on a batch of 2, runs forward, loss and backward, and reports what breaks the
contract. Its errors become a 422 naming the spec field (`dataset.name`, `model_options.hidden`, ...).

In the API the check does not run inside validation, which FastAPI does on the event loop (a check of
seconds would stall every other request): the submit route marks its body's validation as a client
submission (`client_submission`), the validator then only clears any `user_code_check` the client sent
(that field is the server's to set), and the route runs `checked_submission` in a worker thread.

Catalog-only specs never start it. A spec that already carries `user_code_check` (a stored spec validated
again by the dispatcher, a what-if) is not checked again. The check is skipped, and the spec accepted with
the reason in `user_code_check` (and the server log), when torch is not importable here (an API-only
server without the worker extras), when the check runs past USER_CODE_CHECK_TIMEOUT_S, or when its process
dies; the worker then meets any problem at the first point.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from models.registry import is_user_ref
from tula_service.settings import environment

log = logging.getLogger(__name__)

USER_CODE_CHECK_TIMEOUT_S = 30.0  # importing torch and building a small model takes ~2-5 s on one core
USER_CODE_NOTE_MAX_CHARS = 4000  # JobSpec.user_code_check's limit
CHECK_MODULE = "models.user_contract"
Loc = tuple[str | int, ...]

# True while the API validates a submitted body: the check is deferred to the route (see the module docstring).
_CLIENT_SUBMISSION: ContextVar[bool] = ContextVar("tula_client_submission", default=False)


async def client_submission() -> None:
    """A FastAPI dependency of the submit route: it runs in the request's own context just before the body
    is validated, so this flag holds for that validation (and that request) only."""
    _CLIENT_SUBMISSION.set(True)


def validating_client_submission() -> bool:
    """Whether the spec being validated is a client's submission (the submit route's body)."""
    return _CLIENT_SUBMISSION.get()


def field_errors(problems: list[tuple[Loc, str]], error_type: str = "user_code_contract") -> ValidationError:
    """A pydantic ValidationError with one error per (field path, message). Raised inside a validator, its
    paths are kept (prefixed by the enclosing fields), so the API's 422 names each field."""
    return ValidationError.from_exception_data(
        "JobSpec",
        [
            InitErrorDetails(type=PydanticCustomError(error_type, "{message}", {"message": message}), loc=loc, input=None)
            for loc, message in problems
        ],
    )


@dataclass(frozen=True)
class CheckResult:
    problems: list[tuple[Loc, str]]  # (spec field, what is wrong): a 422 when not empty
    note: str  # what the spec records in user_code_check: "passed: ...", "partly checked: ...", "skipped: ..."


def torch_importable() -> bool:
    """Whether this Python can import torch, found without importing it."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _passed_note(report: dict[str, Any]) -> str:
    notes = report.get("notes") or []
    if notes:
        return "partly checked: " + "; ".join(notes)
    dataset, model = report.get("dataset") or {}, report.get("model") or {}
    return (
        f"passed: built on 2 samples; dataset gives {dataset.get('input_kind')} {dataset.get('shape')}, "
        f"model output {model.get('output_shape')}, {model.get('parameters')} parameters"
    )


def run_contract_check(request: dict[str, Any], timeout_s: float = USER_CODE_CHECK_TIMEOUT_S, python: str = sys.executable) -> CheckResult:
    """Run `python -m models.user_contract --check-file` on a profiling request (model, model_options, dataset,
    seed, allowed_model_modules) and read its JSON report."""
    if not torch_importable():
        return CheckResult([], "skipped: torch is not importable by this server's Python (an API-only install "
                               "without the worker extras); the worker checks the user code at the first point")
    with tempfile.TemporaryDirectory(prefix="tula-user-code-") as workdir:
        request_path, out_path = Path(workdir) / "request.json", Path(workdir) / "report.json"
        request_path.write_text(json.dumps(request))  # a file, not an argument: options may be long
        command = [python, "-m", CHECK_MODULE, "--check-file", str(request_path), "--out", str(out_path)]
        try:
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as error:
            return CheckResult([], f"skipped: the check process did not start ({error}); the worker checks the user code at the first point")
        try:
            _, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its own process group: user code's children die too
            child.communicate()
            return CheckResult([], f"skipped: the check did not finish within {timeout_s:g} s (building the dataset "
                                   "and model on 2 samples); the worker checks the user code at the first point")
        if child.returncode != 0 or not out_path.exists():
            last_line = (stderr.strip().splitlines() or ["no output"])[-1][:500]
            return CheckResult([], f"skipped: the check process ended with exit status {child.returncode} ({last_line}); "
                                   "the worker checks the user code at the first point")
        report = json.loads(out_path.read_text())
    problems = [(tuple(error["loc"]), error["message"]) for error in report["errors"]]
    return CheckResult(problems, _passed_note(report))


class _CheckedSpec(Protocol):  # the JobSpec fields this module reads (it cannot import spec.py: spec.py imports it)
    model: str
    model_options: dict[str, Any]
    dataset: Any
    loss: str | None
    profiling: Any
    user_code_check: str | None


def contract_request(spec: _CheckedSpec, allowed_model_modules: list[str]) -> dict[str, Any]:
    """The part of a profiling request the check needs: what models.workload.build_workload reads."""
    return {
        "model": spec.model,
        "model_options": spec.model_options,
        "dataset": spec.dataset.model_dump(mode="json", exclude_none=True),
        "loss": spec.loss,
        "seed": spec.profiling.seed,
        "allowed_model_modules": allowed_model_modules,
        "data_roots": environment().data_roots,
    }


def uses_user_code(spec: _CheckedSpec) -> bool:
    """Whether the spec names user code: a package.module:factory model or dataset, or a package.module:function loss."""
    return is_user_ref(spec.model) or is_user_ref(spec.dataset.name) or (spec.loss is not None and is_user_ref(spec.loss))


def check_user_code(spec: _CheckedSpec, allowed_model_modules: list[str]) -> _CheckedSpec:
    """JobSpec's after-validator: check a spec's user model or dataset once, record how in user_code_check,
    raise a ValidationError naming each field the user code breaks the contract at."""
    if _CLIENT_SUBMISSION.get():
        spec.user_code_check = None  # the server's to set: the route checks in a worker thread
        return spec
    if spec.user_code_check is not None or not uses_user_code(spec):
        return spec
    result = run_contract_check(contract_request(spec, allowed_model_modules))
    if result.problems:
        raise field_errors(result.problems)
    if not result.note.startswith("passed"):
        log.warning("user code of model '%s', dataset '%s': %s", spec.model, spec.dataset.name, result.note)
    spec.user_code_check = result.note[:USER_CODE_NOTE_MAX_CHARS]
    return spec


def checked_submission(spec: _CheckedSpec, allowed_model_modules: list[str]) -> _CheckedSpec:
    """A client's spec, validated under `client_submission`, now checked like any other (blocking: call it
    from a worker thread). Raises the ValidationError of `check_user_code`."""
    token = _CLIENT_SUBMISSION.set(False)
    try:
        return check_user_code(spec, allowed_model_modules)
    finally:
        _CLIENT_SUBMISSION.reset(token)

"""schemathesis hooks (`SCHEMATHESIS_HOOKS=tests.schemathesis_hooks`): generated job specs made to meet the
rules that JSON Schema cannot state (tula_service.spec.submission_schema.SCHEMA_CANNOT_STATE), one repair per
rule, so that the positive-data check holds POST /v1/jobs to "every spec the schema allows and these rules
allow is accepted". Only positive cases are changed: a negative case keeps the violation it was made for.
The repairs read the same catalogs and limits as the validators, and change the least they can.

One more rule is state, not schema: an Idempotency-Key already used with another spec is a 422 (the code
the IETF Idempotency-Key draft gives it), so a positive case that sends a key sends a fresh one. Replays
with the same key are tested in tests/test_api.py and tests/test_durability.py.
"""

from __future__ import annotations

import copy
import math
import uuid
from typing import Any

import schemathesis

from models.data_roots import check_submitted_path
from models.registry import DATASETS, MAX_MODEL_OPTION_INT, MODELS, image_size_problem, loss_problem
from tula_service.settings import environment
from tula_service.spec.job_spec import MAX_BATCH, powers_of_two_between
from tula_service.spec.spec_limits import max_batch_sizes, max_devices

VALID_CSV = "placement,local_bsz,step_time,sync_time\n1,8,0.02,\n1,32,0.05,\n2,32,0.06,0.01\n"


# on the other operations a case hook costs seconds a case
@schemathesis.hook.apply_to(method="POST", path=["/v1/jobs", "/v1/plan", "/v1/jobs/from-measurements", "/v1/runs"])
def map_case(context, case):
    """POST /v1/jobs's body is a spec; POST /v1/plan's and POST /v1/jobs/from-measurements's hold one at "spec",
    with the same repairs, and their `measurements_csv`, whose CSV grammar JSON Schema cannot state, becomes a
    readable table (VALID_CSV); a job from measurements with neither records nor a table gets the table (it
    needs some). The records are left as drawn, bar the rules between their fields: valid ones that cannot be
    planned from are a 409, which the positive check allows."""
    if case.meta is not None and not case.meta.generation.mode.is_positive:
        return case  # a negative case keeps its violation; a stateful step (no meta) draws positive data
    plan = case.operation.path in ("/v1/plan", "/v1/jobs/from-measurements")
    spec = case.body.get("spec") if plan and isinstance(case.body, dict) else case.body
    if isinstance(spec, dict) and case.operation.path != "/v1/runs":  # a run's body is no spec: its key alone is made fresh
        try:
            repaired = meeting_the_rules(copy.deepcopy(spec))
        except (KeyError, TypeError, AttributeError):
            repaired = spec  # a "positive" body the schema does not allow after all (the generator can miss a keyword): sent as drawn
        if plan:
            case.body["spec"] = repaired
            if isinstance(case.body.get("measurements_csv"), str):
                case.body["measurements_csv"] = VALID_CSV
            if isinstance(case.body.get("measurements"), list):
                case.body["measurements"] = [_record_meeting_the_rules(r) for r in case.body["measurements"]]
            job = case.operation.path == "/v1/jobs/from-measurements"
            if job and not case.body.get("measurements") and not case.body.get("measurements_csv"):
                case.body["measurements_csv"] = VALID_CSV
        else:
            case.body = repaired
    for name in list(case.headers or {}):
        if name.lower() == "idempotency-key":
            case.headers[name] = uuid.uuid4().hex
    return case


def _record_meeting_the_rules(record: Any) -> Any:
    """A measurement record changed to meet the rules between its fields (tula_service.measurement): a step's
    sync_time_s below its step_time_s, an "ok" step with a step_time_s, and an "ok" compute point with
    iter_time, memory and model."""
    if not isinstance(record, dict):
        return record
    record = dict(record)
    sync, step = record.get("sync_time_s"), record.get("step_time_s")
    if record.get("kind") == "step" and isinstance(sync, int | float) and isinstance(step, int | float) and sync >= step:
        record["sync_time_s"] = None
    if record.get("kind") == "step" and record.get("status", "ok") == "ok" and record.get("step_time_s") is None:
        record["status"] = "failed"
    if record.get("kind", "compute") in ("compute", "retime") and record.get("status") == "ok":
        if any(record.get(field) is None for field in ("iter_time", "memory", "model")):
            record["status"] = "failed"
    return record


def meeting_the_rules(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` (schema-valid) changed to meet each rule of SCHEMA_CANNOT_STATE."""
    _distinct_batches(spec)
    _batches_within_the_dataset(spec)
    _devices_within_the_limit(spec)
    _max_lr_above_reference(spec)
    _nesterov_that_torch_takes(spec)
    _one_other_run_per_batch(spec)
    _width_splits_into_heads(spec)
    _image_side_the_model_takes(spec)
    _step_placements_that_fit(spec)
    _loss_the_dataset_takes(spec)
    _initial_weights_under_a_data_root(spec)
    return spec


def _initial_weights_under_a_data_root(spec: dict[str, Any]) -> None:
    """initial_weights that are no path under this server's data roots are left out: the random init trains."""
    weights = spec.get("initial_weights")
    if weights is not None and (not isinstance(weights, str) or check_submitted_path(weights, environment().data_roots)):
        spec["initial_weights"] = None


def _nesterov_that_torch_takes(spec: dict[str, Any]) -> None:
    """Nesterov momentum with a momentum of 0, or with dampening, is plain heavy ball (torch.optim.SGD refuses both)."""
    training = spec.get("training")
    if isinstance(training, dict) and training.get("nesterov") is True:
        if training.get("momentum") == 0 or training.get("dampening") not in (None, 0):
            training["nesterov"] = False


def _loss_the_dataset_takes(spec: dict[str, Any]) -> None:
    """A catalog loss the catalog dataset's targets do not fit is left out: the dataset's default trains."""
    loss = spec.get("loss")
    if isinstance(loss, str) and loss_problem(loss, spec["dataset"]["name"]):
        spec["loss"] = None


def _distinct_batches(spec: dict[str, Any]) -> None:
    """At least 2 distinct sizes and at most the server's limit; a range's min below its max."""
    sizes = spec["batch_sizes"]
    if isinstance(sizes, dict):
        low, high = sorted((sizes["min"], sizes["max"]))
        if low == high:
            low, high = (low, high + 1) if high < MAX_BATCH else (low - 1, high)
        spec["batch_sizes"] = {"min": low, "max": high}
        return
    distinct = list(dict.fromkeys(sizes))[: max_batch_sizes()]
    if len(distinct) < 2:
        distinct.append(distinct[0] + 1 if distinct[0] < MAX_BATCH else distinct[0] - 1)
    spec["batch_sizes"] = distinct


def _batches(spec: dict[str, Any]) -> list[int]:
    sizes = spec["batch_sizes"]
    profiled = powers_of_two_between(sizes["min"], sizes["max"]) if isinstance(sizes, dict) else sizes
    others = [run["batch"] for run in spec["training"].get("other_runs") or []]
    return [*profiled, spec["training"]["reference_batch"], *others]


def _batches_within_the_dataset(spec: dict[str, Any]) -> None:
    """Every batch at most num_samples: the dataset grows to the largest batch where it may, else the
    batches shrink to it."""
    dataset, info = spec["dataset"], DATASETS[spec["dataset"]["name"]]
    samples = dataset.get("num_samples") or info.split_sizes.get(dataset.get("split") or "", info.fixed_num_samples)
    needed = max(_batches(spec))
    if samples is None:  # not schema-valid after all (the generator can miss a `required`): schemathesis drops it
        return
    if samples >= needed:
        return
    samples = needed if info.max_num_samples is None else min(needed, info.max_num_samples)
    dataset["num_samples"] = samples
    if needed > samples:
        sizes = spec["batch_sizes"]
        if isinstance(sizes, dict):
            spec["batch_sizes"] = {"min": min(sizes["min"], samples - 1), "max": min(sizes["max"], samples)}
        else:
            spec["batch_sizes"] = sorted({min(b, samples) for b in sizes} | {samples - 1})
        training = spec["training"]
        training["reference_batch"] = min(training["reference_batch"], samples)
        for run in training.get("other_runs") or []:
            run["batch"] = min(run["batch"], samples)


def _devices_within_the_limit(spec: dict[str, Any]) -> None:
    cluster, limit = spec["cluster"], max_devices()
    nodes = min(cluster.get("nodes", 1), limit)
    cluster["nodes"] = nodes
    cluster["gpus_per_node"] = min(cluster.get("gpus_per_node", 1), limit // nodes)


def _step_placements_that_fit(spec: dict[str, Any]) -> None:
    """Each step placement cut to the cluster's nodes and GPUs per node; one of fewer than 2 devices dropped."""
    placements = (spec.get("profiling") or {}).get("step_placements")
    if not placements:
        return
    cluster = spec["cluster"]
    nodes, per_node = int(cluster.get("nodes", 1)), int(cluster.get("gpus_per_node", 1))  # JSON's 4.0 is 4
    cut = [[min(gpus, per_node) for gpus in placement[:nodes]] for placement in placements]
    spec["profiling"]["step_placements"] = [placement for placement in cut if sum(placement) >= 2]


def _max_lr_above_reference(spec: dict[str, Any]) -> None:
    """max_lr without reference_lr gets it at max_lr (no headroom: the least change); one below it, the two swapped."""
    training = spec["training"]
    if training.get("max_lr") is not None and training.get("reference_lr") is None:
        training["reference_lr"] = training["max_lr"]
    if training.get("max_lr") is not None and training["max_lr"] < training["reference_lr"]:
        training["max_lr"], training["reference_lr"] = training["reference_lr"], training["max_lr"]


def _one_other_run_per_batch(spec: dict[str, Any]) -> None:
    training = spec["training"]
    runs = {run["batch"]: run for run in training.get("other_runs") or [] if run["batch"] != training["reference_batch"]}
    if "other_runs" in training:
        training["other_runs"] = list(runs.values())


def _width_splits_into_heads(spec: dict[str, Any]) -> None:
    defaults = MODELS[spec["model"]].options
    if not {"width", "heads"} <= defaults.keys():
        return
    options = spec.setdefault("model_options", {})
    width, heads = options.get("width", defaults["width"]), options.get("heads", defaults["heads"])
    if width % heads:
        rounded = heads * math.ceil(width / heads)
        options["width"] = rounded if rounded <= MAX_MODEL_OPTION_INT else heads


def _image_side_the_model_takes(spec: dict[str, Any]) -> None:
    """The smallest side, from the dataset's (given or default) up, that the model takes."""
    dataset, info = spec["dataset"], DATASETS[spec["dataset"]["name"]]
    side = dataset.get("image_size") or info.fields.get("image_size")
    if isinstance(side, float) and side.is_integer():  # JSON's 4.0 is the integer 4 to the spec
        side = int(side)
    if not isinstance(side, int):
        return
    while image_size_problem(spec["model"], side) is not None:
        side += 1
    dataset["image_size"] = side

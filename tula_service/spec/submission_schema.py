"""The request schema of `POST /v1/jobs` ("JobSubmission"): JobSpec's, narrowed to what its validators accept.

pydantic derives JobSpec's JSON Schema from its field types: a model name is "any string", and the rules
between fields (the model takes the dataset's inputs, a price or a GPU with a catalog price, ...) are
nowhere. A client, a form generator or schemathesis reading that schema sends specs the API refuses. This
module publishes, from the catalogs, registry and limits the validators themselves read:

- names: models, datasets, GPU types and interconnects as enums; an allowlisted `package.module:factory`
  as a pattern per allowed module prefix (none without an allowlist);
- per catalog dataset: the fields it takes (the others null), the ones it needs, num_samples when it has
  no size of its own, its largest num_samples; a file dataset only with data roots, its `path` a pattern
  under them (absolute, no `..`);
- per catalog model: its model_options (integers in [1, 10^6]) and the datasets of its input kind;
- cluster: `device_memory_gib` or a catalog `gpu_type`; pricing: a `price`, or kind `gpu_hour` with a
  `gpu_type` (its catalog price); objective `deadline`/`budget` with `deadline_h`/`budget_usd`; `max_lr`
  with `reference_lr`; each optimizer setting (`momentum`, `betas`, `weight_decay`, ...) with an optimizer that has it, `nesterov` true with a
  momentum above 0; `batch_sizes` as a list of 2 or more, or `{min, max}`;
- `loss`: a catalog loss name or an allowlisted `package.module:function`.

What JSON Schema cannot state is listed in SCHEMA_CANNOT_STATE, and said in the schema's description:
comparisons between two numbers of the spec, counting distinct values, and running user code. So is the
image side each catalog model takes: exact, it would need an alternative per model, and schema tools
(schemathesis's generator among them) give up on the product of those with the other alternatives.
The server-set fields (`*_source`, `user_code_check`) are accepted and ignored in a submission
(tula_service.spec.job_spec), so the schema leaves them as they are.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

from models.registry import DATASETS, LOSSES, MAX_MODEL_OPTION_INT, MODELS, PROBABILITY_OPTIONS, DatasetInfo, ModelInfo
from tula_service.catalogs import load_gpus, load_interconnects
from tula_service.settings import environment
from tula_service.spec.job_spec import OPTIMIZER_NAMES, OPTIMIZER_SETTING_DEFAULTS, allowed_model_modules
from tula_service.spec.spec_limits import max_batch_sizes

COMPONENT = "JobSubmission"
SUBMIT_PATH = "/v1/jobs"

# The rules of tula_service.spec.job_spec that compare two values or count distinct ones: JSON Schema has no
# keyword for them. Each is still a 422 naming its field.
SCHEMA_CANNOT_STATE = (
    "batch_sizes: at least 2 distinct sizes, at most TULA_MAX_BATCH_SIZES (64) distinct; a range's min below its max",
    "every batch (batch_sizes, training.reference_batch, training.other_runs[].batch) at most dataset.num_samples",
    "cluster.nodes x cluster.gpus_per_node at most TULA_MAX_DEVICES (65536)",
    "training.max_lr only with training.reference_lr, and at least it (stated beside the optimizers' settings, the "
    "first half made a product of alternatives that schema tools give up on once Adafactor made the optimizers nine)",
    "training.nesterov true only with a training.momentum above 0 (or left out: 0.9) and no dampening (stated beside the "
    "optimizers' settings, it made a product of alternatives that schema tools give up on)",
    "training.other_runs: one run per batch, none at training.reference_batch",
    "initial_weights: null, or a string path under the server's data roots as dataset.path's (absolute, no '..'; none "
    "without data roots). Stated here, not in the schema: one more constrained field, even its type, made the schema too "
    "much for schema tools' canonicalizer",
    "model_options of gpt: width a multiple of heads",
    "dataset.image_size (or the dataset's default side) at least the model's min_image_size, a multiple of its "
    "image_size_multiple (GET /v1/catalog/models)",
    "a user (package.module:factory) model, dataset or loss: its contract, checked by running it on 2 samples",
    "loss: one that takes the catalog dataset's targets (GET /v1/catalog/losses and /datasets: cross_entropy on class "
    "labels and tokens; mse or l1 on diabetes's float targets; bce_with_logits on a user dataset's)",
    "profiling.step_placements: each uses 2 or more devices, on at most cluster.nodes nodes, at most "
    "cluster.gpus_per_node GPUs on each",
)

_USER_REF_TAIL = r"(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"  # models.registry's "package.module:factory", after the prefix
_NULL = {"type": "null"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def _user_ref_patterns(prefixes: list[str]) -> list[dict[str, Any]]:
    """A pattern per allowlisted module prefix: the prefix, then whole dotted components (models.registry)."""
    return [{"type": "string", "pattern": "^" + re.escape(p.rstrip(".")) + _USER_REF_TAIL}
            for p in prefixes if p.rstrip(".")]


def _path_pattern(roots: list[str]) -> dict[str, Any]:
    """models.data_roots.check_submitted_path as a pattern: absolute, no '..' part, under a root."""
    segment = r"(/(?!\.\.(/|$))[^/]*)"
    alternatives = ["" if os.path.normpath(r) == "/" else re.escape(os.path.normpath(r)) for r in roots]
    return {"type": "string", "maxLength": 4096,
            "pattern": "^(" + "|".join(alternatives) + ")" + segment + "*$"}


def _dataset_variant(info: DatasetInfo, base: dict[str, Any], roots: list[str]) -> dict[str, Any] | None:
    """One catalog dataset's schema; None when it cannot be used here (a file dataset without data roots)."""
    if "path" in info.fields and not roots:
        return None
    properties = copy.deepcopy(base["properties"])
    properties["name"] = {"const": info.name}
    properties["options"] = _NULL
    required = ["name", *info.required]
    for field in properties:
        if field in ("name", "num_samples", "options"):
            continue
        if field not in info.fields:
            properties[field] = _NULL
    if "path" in info.fields:
        properties["path"] = _path_pattern(roots)
    samples = {"type": "integer", "minimum": 1, "maximum": base["properties"]["num_samples"]["anyOf"][0]["maximum"]}
    if info.max_num_samples is not None:
        samples["maximum"] = min(samples["maximum"], info.max_num_samples)
    if info.fixed_num_samples is None:
        properties["num_samples"] = samples
        required.append("num_samples")
    else:
        properties["num_samples"] = _nullable(samples)
    return {"type": "object", "properties": properties, "required": sorted(set(required)), "additionalProperties": False}


def _user_dataset_variants(base: dict[str, Any], prefixes: list[str]) -> list[dict[str, Any]]:
    """An allowlisted user dataset: any of the fields (its factory receives them) and num_samples."""
    variants = []
    for pattern in _user_ref_patterns(prefixes):
        properties = copy.deepcopy(base["properties"])
        properties["name"] = pattern
        properties["num_samples"] = base["properties"]["num_samples"]["anyOf"][0]
        properties.pop("path", None)  # a user dataset reads its own files: `path` is a catalog file dataset's
        variants.append({"type": "object", "properties": properties, "required": ["name", "num_samples"],
                         "additionalProperties": False})
    return variants


def _model_options_schema(model: ModelInfo) -> dict[str, Any]:
    """models.registry.resolved_model_options: the model's own options, each a size in [1, 10^6] or a probability in
    [0, 1) (PROBABILITY_OPTIONS)."""
    size = {"type": "integer", "minimum": 1, "maximum": MAX_MODEL_OPTION_INT}
    probability = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
    properties = {name: probability if name in PROBABILITY_OPTIONS else size for name in model.options}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _dataset_variants(dataset_base: dict[str, Any], roots: list[str], prefixes: list[str]) -> list[dict[str, Any]]:
    """Every dataset a spec may name: each usable catalog dataset's variant, and the allowlisted user ones."""
    catalog = [_dataset_variant(info, dataset_base, roots) for info in DATASETS.values()]
    return [d for d in catalog if d is not None] + _user_dataset_variants(dataset_base, prefixes)


def _model_groups(roots: list[str], prefixes: list[str]) -> list[dict[str, Any]]:
    """One alternative per set of catalog models that take the same options and inputs: those models, their options,
    and the names of the datasets (catalog and allowlisted user ones) they can train on. The datasets' own variants
    are stated once (job_submission_schema's `dataset`), not per group: a product of groups and variants grew past
    what schemathesis's generator can resolve (its canonical form went unresolved when a second signal dataset came)."""
    groups: dict[tuple, list[ModelInfo]] = {}
    for model in MODELS.values():
        groups.setdefault((model.input_kind, tuple(sorted(model.options))), []).append(model)
    users = _user_ref_patterns(prefixes)
    usable = [info for info in DATASETS.values() if "path" not in info.fields or roots]
    alternatives = []
    for (input_kind, _options), models in groups.items():
        names = sorted(info.name for info in usable if info.input_kind == input_kind)
        if not names and not users:
            continue
        alternatives.append({
            "properties": {
                "model": {"enum": sorted(m.name for m in models)},
                "model_options": _model_options_schema(models[0]),
                "dataset": {"properties": {"name": {"anyOf": [*([{"enum": names}] if names else []), *users]}}},
            },
        })
    for pattern in users:  # a user model may try any dataset (its contract check decides)
        alternatives.append({"properties": {"model": pattern}})
    return alternatives


def _cluster_schema(base: dict[str, Any]) -> dict[str, Any]:
    """Catalog names as enums; device memory given, or a catalog gpu_type that has it."""
    gpus = {"type": "string", "enum": sorted(load_gpus())}
    links = {"type": "string", "enum": sorted(load_interconnects())}
    cluster = copy.deepcopy(base)
    cluster["properties"]["gpu_type"] = {**_nullable(gpus), "description": base["properties"]["gpu_type"].get("description", "")}
    for name in ("intra_node_link", "inter_node_link"):
        cluster["properties"][name] = {**_nullable(links), "description": base["properties"][name].get("description", "")}
    cluster["anyOf"] = [
        {"required": ["gpu_type"], "properties": {"gpu_type": gpus}},
        {"required": ["device_memory_gib"], "properties": {"device_memory_gib": {"type": "number", "exclusiveMinimum": 0}}},
    ]
    return cluster


def _optimizer_settings_schema() -> dict[str, Any]:
    """Each optimizer setting only with an optimizer that has it (job_spec.OPTIMIZER_SETTING_DEFAULTS): one branch per
    optimizer, the settings it lacks absent or null; SGD's branch also holds where optimizer is left out (SGD is the
    default). One anyOf of a branch per optimizer, not an anyOf per setting: schemathesis' canonicalizer gives up on an
    allOf of ten or more anyOfs (their product), and it must generate requests from this schema."""
    branches = []
    for optimizer in OPTIMIZER_NAMES:
        absent = {name: _NULL for name, defaults in OPTIMIZER_SETTING_DEFAULTS.items() if optimizer not in defaults}
        branch = {"properties": {"optimizer": {"const": optimizer}, **absent}}
        branches.append(branch if optimizer == "sgd" else {**branch, "required": ["optimizer"]})
    return {"anyOf": branches}


def _training_schema(base: dict[str, Any]) -> dict[str, Any]:
    """Each optimizer setting only with an optimizer that has it (_optimizer_settings_schema). Nesterov's own rule and
    max_lr's need of reference_lr are in SCHEMA_CANNOT_STATE: stated here as two more alternatives each, the schema
    outgrew schemathesis' canonicalizer, Nesterov's once Adagrad made the optimizers eight, max_lr's once Adafactor made
    them nine."""
    training = copy.deepcopy(base)
    training["allOf"] = [_optimizer_settings_schema()]
    return training


def _batch_sizes_schema(base: dict[str, Any]) -> dict[str, Any]:
    size = base["items"]
    return {
        "description": base.get("description", ""),
        "anyOf": [
            {"type": "array", "items": size, "minItems": 2},
            {"type": "object", "properties": {"min": size, "max": size}, "required": ["min", "max"],
             "additionalProperties": False},
        ],
    }


def job_submission_schema(components: dict[str, Any]) -> dict[str, Any]:
    """The JobSubmission schema from the OpenAPI document's components (JobSpec and the ones it names)."""
    roots, prefixes = environment().data_roots, allowed_model_modules()
    spec = copy.deepcopy(components["JobSpec"])
    properties = spec["properties"]
    gpus = sorted(load_gpus())
    properties["model"] = {"type": "string", "description": properties["model"].get("description", "")}
    properties["batch_sizes"] = _batch_sizes_schema(properties["batch_sizes"])
    properties["cluster"] = _cluster_schema(components["ClusterSpec"])
    properties["training"] = _training_schema(components["TrainingSpec"])
    properties["dataset"] = {"description": components["DatasetSpec"].get("description", ""),
                             "anyOf": _dataset_variants(components["DatasetSpec"], roots, prefixes)}
    properties["loss"] = {"description": properties["loss"].get("description", ""),
                          "anyOf": [_NULL, {"enum": sorted(LOSSES)}, *_user_ref_patterns(prefixes)]}
    properties["pricing"] = copy.deepcopy(components["PricingSpec"])
    # its rule (a path under a data root) is in SCHEMA_CANNOT_STATE: any constraint here, even {"type": "null"}, made the
    # schema too much for schemathesis' canonicalizer (test_submission_schema)
    properties["initial_weights"] = {"description": properties["initial_weights"].get("description", "")}
    limits = "\n".join(f"- {rule}" for rule in SCHEMA_CANNOT_STATE)
    spec["description"] = (
        "A job spec as POST /v1/jobs accepts it. Besides this schema, these rules hold (a 422 names the field):\n"
        + limits + f"\n(at most {max_batch_sizes()} batch sizes on this server)"
    )
    spec["title"] = COMPONENT
    spec["allOf"] = [
        {"anyOf": _model_groups(roots, prefixes)},
        {"anyOf": [  # a price, or the catalog's per GPU-hour for a known gpu_type
            {"properties": {"pricing": {"required": ["price"], "properties": {"price": {"type": "number", "exclusiveMinimum": 0}}}}},
            {"required": ["cluster"], "properties": {
                "pricing": {"properties": {"kind": {"const": "gpu_hour"}}},
                "cluster": {"required": ["gpu_type"], "properties": {"gpu_type": {"enum": gpus}}},
            }},
        ]},
        {"anyOf": [  # objectives with a constraint need it
            {"properties": {"objective": {"enum": ["knee", "min_time", "min_cost"]}}},
            {"required": ["objective", "deadline_h"], "properties": {
                "objective": {"const": "deadline"}, "deadline_h": {"type": "number", "exclusiveMinimum": 0}}},
            {"required": ["objective", "budget_usd"], "properties": {
                "objective": {"const": "budget"}, "budget_usd": {"type": "number", "exclusiveMinimum": 0}}},
        ]},
    ]
    return spec


def publish_job_submission(openapi: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document with JobSubmission as POST /v1/jobs's request body, in place."""
    components = openapi["components"]["schemas"]
    components[COMPONENT] = job_submission_schema(components)
    body = openapi["paths"][SUBMIT_PATH]["post"]["requestBody"]["content"]["application/json"]
    body["schema"] = {"$ref": f"#/components/schemas/{COMPONENT}"}
    return openapi

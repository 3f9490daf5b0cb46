"""POST /v1/plan on a real server: a spec plus measurements (records and/or a CSV of measured steps) in, a
recommendation out, nothing stored; bad records and rows are 422s naming where they are."""

import httpx
import numpy as np
import pytest

from tests.conftest import REPO
from tests.handmade import measurement, spec_dict
from tests.test_step_time import BATCHES, CLUSTER, MEASURED_PLACEMENTS, step, true_step_s
from tula_service.measurement_csv import CsvRowError, dealt_evenly, parse_placement, steps_from_csv
from tula_service.plan.recommendation import Recommendation


def _spec(**overrides) -> dict:
    return spec_dict(batch_sizes=BATCHES, cluster=CLUSTER, **overrides)


def _csv(rows: list[tuple[list[int], int]]) -> str:
    lines = ["placement,local_bsz,step_time,sync_time"]
    lines += [f"{''.join(map(str, p))},{b},{true_step_s(p, b)}," for p, b in rows]
    return "\n".join(lines) + "\n"


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/plan", json=body, timeout=120)


def test_records_plan_to_a_recommendation_and_nothing_is_stored(api_only):
    records = [measurement(b) for b in BATCHES] + [step(p, b) for p in MEASURED_PLACEMENTS for b in (16, 64)]
    response = _post(api_only, {"spec": _spec(objective="min_time"), "measurements": records})
    assert response.status_code == 200, response.text
    body = response.json()
    Recommendation.model_validate(body)
    assert body["measurements"] == {"compute": len(BATCHES), "step": 2 * len(MEASURED_PLACEMENTS)}
    assert body["models"]["step_time"]["model"] == "placement"
    assert body["chosen"]["placement_kind"] in ("packed", "even", "spread")
    assert httpx.get(f"{api_only.url}/v1/jobs", timeout=10).json()["total"] == 0  # stateless


def test_placements_beyond_the_measured_steps_are_labelled_extrapolated(api_only):
    records = [measurement(b) for b in BATCHES] + [step(p, b) for p in ([2], [1, 1], [2, 2]) for b in (16, 64)]
    response = _post(api_only, {"spec": _spec(), "measurements": records})
    assert response.status_code == 200, response.text
    by_placement = {tuple(c["placement"]): c["extrapolated"] for c in response.json()["candidates"]}
    assert by_placement[(1,)] == [] and by_placement[(2, 2)] == [] and by_placement[(1, 1)] == []
    assert by_placement[(4, 4, 4, 4)] == ["devices", "nodes", "gpus_per_node"]
    assert by_placement[(1, 1, 1, 1)] == ["nodes"]  # 4 devices were measured ([2, 2]), on 2 nodes at most
    assert by_placement[(4,)] == ["gpus_per_node"]


def test_a_csv_of_steps_alone_plans_with_memory_assumed(api_only):
    rows = [([1], b) for b in (8, 16, 32, 64, 128)] + [(p, b) for p in MEASURED_PLACEMENTS for b in (16, 64)]
    response = _post(api_only, {"spec": _spec(), "measurements_csv": _csv(rows)})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["measurements"] == {"step": len(rows)}
    assert body["models"]["memory"]["source"] == "assumed" and body["curves"]["memory"] is None
    assert body["search_space"]["max_device_batch"] == {"value": 128, "source": "assumed"}
    assert all(row["memory_bytes"] == {"value": None, "source": "assumed"} for row in body["candidates"])
    assert body["models"]["network"]["gradient_bytes"]["value"] is None


def test_a_bad_record_is_a_422_naming_its_index_and_field(api_only):
    records = [measurement(b) for b in BATCHES] + [{**step([2, 2], 16), "step_time_s": -1}]
    response = _post(api_only, {"spec": _spec(), "measurements": records})
    assert response.status_code == 422
    fields = [error["field"] for error in response.json()["errors"]]
    assert f"body.measurements.{len(BATCHES)}.step_time_s" in fields


def test_a_bad_csv_row_is_a_422_naming_the_row_and_the_column(api_only):
    text = _csv([([1], 8), ([1], 16)]) + "22,32,fast,\n"
    response = _post(api_only, {"spec": _spec(), "measurements_csv": text})
    assert response.status_code == 422
    [error] = response.json()["errors"]
    assert error["field"] == "body.measurements_csv" and "row 3, column 'step_time'" in error["message"]


def test_steps_that_cannot_predict_the_all_reduce_are_a_409_saying_what_is_missing(api_only):
    text = _csv([([1], 8), ([1], 16), ([2], 16)])  # one multi-GPU placement, and no model size
    response = _post(api_only, {"spec": _spec(), "measurements_csv": text})
    assert response.status_code == 409  # each row is valid; together they cannot be planned from
    assert "3 or more placements" in response.json()["detail"]


def test_csv_layouts_and_placements():
    assert parse_placement("22") == [2, 2] and parse_placement("8+8") == [8, 8] and parse_placement(" 4 ") == [4]
    assert dealt_evenly(6, 4) == [2, 2, 1, 1]
    replicas = steps_from_csv("num_nodes,num_replicas,local_bsz,step_time,sync_time,extra\n2,3,16,0.5,0.1,x\n")
    assert replicas == [{"kind": "step", "placement": [2, 1], "device_batch": 16, "step_time_s": 0.5, "sync_time_s": 0.1, "origin": "csv"}]
    for text, where in (
        ("placement,local_bsz\n1,2\n", "the header: no known layout"),
        ("placement,local_bsz,step_time\n", "row 1: the table has a header but no rows"),
        ("placement,local_bsz,step_time,sync_time\n1,8,0.1,0.2\n", "row 1, column 'sync_time'"),
        ("placement,local_bsz,step_time\n1,8.5,0.1\n", "row 1, column 'local_bsz'"),
        ("placement,local_bsz,step_time\n0,8,0.1\n", "row 1, column 'placement'"),
    ):
        with pytest.raises(CsvRowError, match=where):
            steps_from_csv(text)


def test_tula_plan_sends_a_spec_and_measurement_files_and_prints_the_plan(api_only, tmp_path):
    import json

    import yaml

    from tests.test_cli import tula

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(_spec(objective="min_time")))
    compute = tmp_path / "compute.jsonl"
    compute.write_text("".join(json.dumps(measurement(b)) + "\n" for b in BATCHES))
    steps = tmp_path / "steps.csv"
    steps.write_text(_csv([(p, b) for p in MEASURED_PLACEMENTS for b in (16, 64)]))
    result = tula("plan", "--server", api_only.url, "--spec", str(spec_path), "--measurements", str(compute),
                  "--measurements", str(steps), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["measurements"] == {"compute": len(BATCHES), "step": 2 * len(MEASURED_PLACEMENTS)}
    assert body["models"]["step_time"]["model"] == "placement"
    human = tula("plan", "--server", api_only.url, "--spec", str(spec_path), "--measurements", str(compute), "--measurements", str(steps))
    assert human.returncode == 0 and "chosen: global batch" in human.stdout
    steps_only = tmp_path / "steps_only.csv"
    steps_only.write_text(_csv([([1], b) for b in BATCHES] + [(p, b) for p in MEASURED_PLACEMENTS for b in (16, 64)]))
    human = tula("plan", "--server", api_only.url, "--spec", str(spec_path), "--measurements", str(steps_only))
    assert human.returncode == 0, human.stderr
    assert "memory not measured" in human.stdout
    bad = tmp_path / "bad.csv"
    bad.write_text("placement,local_bsz,step_time\n1,8,0.1\n1,x,0.2\n")
    refused = tula("plan", "--server", api_only.url, "--spec", str(spec_path), "--measurements", str(bad))
    assert refused.returncode != 0 and "row 2, column 'local_bsz'" in refused.stderr
    mixed = tula("plan", "job-1", "--measurements", str(steps))
    assert mixed.returncode == 2 and "--spec FILE and no job id" in mixed.stderr
    stats = tmp_path / "stats.jsonl"  # the reference run's statistics beside the spec, as for tula submit
    stats.write_text("".join(json.dumps({"samples": 3200 * i, "batch": 32, "grad_sqr": 1.0 / i, "trace_sigma": 40.0,
                                         "loss": 2.3 / (1 + 0.1 * i)}) + "\n" for i in range(1, 41)))  # fmt: skip
    result = tula("plan", "--server", api_only.url, "--spec", str(spec_path), "--measurements", str(compute),
                  "--measurements", str(steps), "--reference-stats", str(stats), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["models"]["efficiency"]["noise_scale"]["evidence"] == "reference_run"


TRACES = REPO / ".." / "shared" / "data" / "pollux-traces"


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/pollux-traces is not beside this checkout")
def test_real_gpu_traces_in_both_csv_layouts_plan_through_the_api(api_only):
    """The Pollux testbed's measured steps (4 nodes x 4 T4, PCIe 3.0, 50 GbE) as a user would send them."""
    spec = spec_dict(
        name="pollux-imagenet", batch_sizes=[32, 64],
        cluster={"nodes": 4, "gpus_per_node": 4, "device_memory_gib": 16, "interconnect_gbps": None,
                 "intra_node_link": "pcie3_x16", "inter_node_link": "ethernet_50g"},
        training={"reference_batch": 200, "reference_epochs": 65},
    )  # fmt: skip
    placements = (TRACES / "imagenet" / "placements.csv").read_text()
    response = _post(api_only, {"spec": spec, "measurements_csv": placements})
    assert response.status_code == 200, response.text
    body = response.json()
    step_time = body["models"]["step_time"]
    assert step_time["model"] == "placement" and step_time["multi_device_steps"] > 500
    assert step_time["held_out_median_rel_err"] < 0.15  # leave-placement-out over the trace's own placements
    assert body["chosen"]["step_time_s"]["source"] in ("measured", "predicted")
    scalability = (TRACES / "imagenet" / "scalability.csv").read_text()  # num_nodes,num_replicas,... rows
    single = "\n".join(line for line in placements.splitlines() if line.startswith(("placement", "1,")))
    lines = ["num_nodes,num_replicas,local_bsz,step_time,sync_time", *scalability.splitlines()[1:]]
    lines += [f"1,1,{row.split(',', 1)[1]}" for row in single.splitlines()[1:]]
    response = _post(api_only, {"spec": spec, "measurements_csv": "\n".join(lines) + "\n"})
    assert response.status_code == 200, response.text
    assert response.json()["models"]["step_time"]["model"] == "placement"


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/pollux-traces is not beside this checkout")
@pytest.mark.parametrize("name", ["cifar10", "imagenet"])
def test_a_reference_run_sent_through_the_api_predicts_the_other_runs_as_the_benchmark_does(api_only, name):
    """The held-out check's path: a real GPU run's rows (every one, past the target too) as
    training.reference_run.gradient_stats, the trace's measured steps as a CSV, POST /v1/plan on a real server. The
    epochs curve it answers is benchmarks/statistical_efficiency.py's model, within the Pollux target of the other
    runs' measured epochs, and its calibrated band holds the prediction."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import pollux_traces
    import statistical_efficiency as se

    app = pollux_traces.APPLICATIONS[name]
    task = se.pollux_task(app)
    ref = task.reference_batch
    records = pollux_traces.gradient_stats(app, ref, pollux_traces.load_runs(app)[ref])
    assert records[-1]["samples"] > task.epochs[ref] * app.dataset_size  # the run goes on past its target
    spec = spec_dict(
        name=f"pollux-{name}", batch_sizes=[32, 64], objective="min_time",
        dataset={"name": "synthetic_images", "num_samples": app.dataset_size},
        cluster={"nodes": 4, "gpus_per_node": 4, "device_memory_gib": 16, "interconnect_gbps": None,
                 "intra_node_link": "pcie3_x16", "inter_node_link": "ethernet_50g"},
        training={"reference_batch": ref, "reference_epochs": task.epochs[ref], "optimizer": "sgd",
                  "reference_run": {"gradient_stats": records}},
    )  # fmt: skip
    response = _post(api_only, {"spec": spec, "measurements_csv": (TRACES / name / "placements.csv").read_text()})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["models"]["efficiency"]["noise_scale"]["evidence"] == "reference_run"
    curve = body["curves"]["epochs"]
    log_batch, log_epochs = np.log(curve["global_batch"]), np.log(curve["epochs"])
    predicted = {b: float(np.exp(np.interp(np.log(b), log_batch, log_epochs))) for b in task.epochs}
    direct, _ = se.service_model(task, ref)
    assert predicted == pytest.approx({b: float(direct.predict(b)) for b in task.epochs}, rel=2e-3)  # the benchmark's model
    assert se.median_abs(se.epochs_errors_pct(task, predicted.get, ref)) <= se.POLLUX_EPOCHS_TARGET_PCT
    assert all(low <= e <= high for low, e, high in zip(curve["calibrated_low"], curve["epochs"], curve["calibrated_high"]))
    chosen = body["chosen"]
    low, high = chosen["epochs"]["calibrated_interval"]
    assert low < chosen["epochs"]["value"] < high and chosen["total_time_s"]["calibrated_interval"][1] > chosen["total_time_s"]["value"]

"""The `tula` CLI as a user runs it, against a real server."""

import argparse
import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, LiveServer, free_port
from tests.handmade import spec_dict
from tula_service.cli.client import duration_h
from tula_service.client import TulaClient

EXAMPLE = REPO / "configs" / "example_small_cnn.yaml"


def tula(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tula_service", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.e2e
def test_submit_wait_prints_progress_and_the_recommendation_then_show_repeats_it(live_server):
    result = tula("submit", str(EXAMPLE), "--wait", "--poll-s", "0.5", "--server", live_server.url)
    assert result.returncode == 0, result.stderr
    assert re.search(r"\] (\d+)/\1 points  done", result.stdout)  # 6 planned; the server may measure some again
    assert "chosen: global batch" in result.stdout and "predicted total time" in result.stdout
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    shown = tula("show", job_id, "--server", live_server.url)
    assert shown.returncode == 0 and "chosen: global batch" in shown.stdout


def test_invalid_spec_file_is_a_clear_error_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("price: 2.5", "price: -3").replace("model: small_cnn", "model: resnet5"))
    result = tula("submit", str(bad), "--server", "http://127.0.0.1:9")
    assert result.returncode != 0
    assert "pricing.price" in result.stderr and "'resnet5' is not in the catalog" in result.stderr


def test_missing_spec_file_is_a_clear_error(tmp_path):
    result = tula("submit", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "cannot read spec" in result.stderr


def test_unreachable_server_is_a_clear_error():
    result = tula("show", "abc", "--server", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2 and "cannot reach the Tula server" in result.stderr


# --- against servers: an API-only one (jobs stay queued) and one holding a done job -----------------

DONE_SPEC = {
    "name": "cli-done",
    "model": "small_cnn",
    "dataset": {"name": "synthetic_images", "num_samples": 50_000, "channels": 3, "image_size": 32, "num_classes": 10},
    "batch_sizes": [8, 16, 32],
    "cluster": {"nodes": 1, "gpus_per_node": 4, "device_memory_gib": 16, "interconnect_gbps": 100},
    "pricing": {"kind": "gpu_hour", "price": 2.5},
    "training": {"reference_batch": 32, "reference_epochs": 10},
    "profiling": {"time_cap_s": 0.5, "grad_iters": 2, "measure_comm": False},
}


@pytest.fixture(scope="module")
def done_job(tmp_path_factory):
    """A real job profiled by a local executor: (server, job id, the `submit --wait` run)."""
    folder = tmp_path_factory.mktemp("cli-done")
    spec_path = folder / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(DONE_SPEC))
    server = LiveServer(folder / "tula.db", folder / "server.log", ("--executor", "local")).start()
    submitted = tula("submit", str(spec_path), "--wait", "--poll-s", "0.3", "--server", server.url, "--timeout-s", "600")
    assert submitted.returncode == 0, submitted.stderr + server.log_path.read_text()
    yield server, submitted.stdout.split("submitted job ")[1].split()[0], submitted
    server.stop()


def submit_queued(server, **overrides) -> str:
    with TulaClient(server.url) as client:
        return client.submit(spec_dict(**overrides)).id


def test_submit_wait_shows_the_bar_and_the_recommendation(done_job):
    _, _, submitted = done_job
    assert re.search(r"\] (\d+)/\1 points  done", submitted.stdout) and "[" + "#" * 30 + "]" in submitted.stdout
    assert "chosen: global batch" in submitted.stdout


def test_the_recommendation_is_in_human_units(done_job):
    _, _, submitted = done_job
    lines = submitted.stdout.splitlines()
    predicted = next(line for line in lines if line.startswith("  predicted total time"))
    assert re.fullmatch(
        r"  predicted total time [\d.]+ (ms|s|min|h|d), cost \$[\d,]+\.\d\d, memory [\d.]+ (B|KiB|MiB|GiB) \(\w+\),"
        r" epochs [\d.]+ \(\w+\)", predicted,
    ), predicted  # fmt: skip
    header = lines.index(next(line for line in lines if line.split()[:1] == ["BATCH"]))
    assert lines[header].split() == ["BATCH", "DEVICE_B", "DEVICES", "ACC", "MEMORY", "ITER", "EPOCHS", "EPOCHS_80%", "TOTAL", "COST"]
    for row in lines[header + 1 : lines.index(next(line for line in lines if line.startswith("(")))]:
        memory, iteration, epochs, total, cost = row.split()[4:6], row.split()[6:8], row.split()[8:10], row.split()[10:12], row.split()[12]
        assert memory[1] in ("KiB", "MiB", "GiB") and iteration[1] in ("ms", "s") and total[1] in ("s", "min", "h", "d"), row
        assert re.fullmatch(r"\$[\d,]+\.\d\d", cost) and len(memory[0].replace(".", "")) <= 3, row
        assert re.fullmatch(r"[\d.,]+", epochs[0]) and re.fullmatch(r"[\d.,]+-[\d.,]+", epochs[1]), row  # value, its 80% interval


def test_submit_json_prints_the_job_and_the_key_makes_it_idempotent(api_only, tmp_path):
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec_dict(name="keyed")))
    runs = [tula("submit", str(spec_path), "--json", "--idempotency-key", "k-1", "--server", api_only.url) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    first, second = (json.loads(run.stdout) for run in runs)
    assert first["id"] == second["id"] and first["state"] == "queued" and "submitted job" in runs[0].stderr


def test_status_lists_jobs_with_their_progress(api_only):
    job_id = submit_queued(api_only, name="listed", batch_sizes=[8, 16, 32])
    listed = tula("status", "--server", api_only.url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(job_id))
    assert row.split()[1:5] == ["listed", "small_cnn", "queued", "0/3"]
    assert listed.stdout.splitlines()[0].split()[:4] == ["ID", "NAME", "MODEL", "STATE"]


def test_status_filters_by_state_and_limits_and_prints_json(api_only):
    cancelled = submit_queued(api_only, name="to-cancel")
    assert tula("cancel", cancelled, "--server", api_only.url).returncode == 0
    submit_queued(api_only)
    only = json.loads(tula("status", "--state", "cancelled", "--json", "--server", api_only.url).stdout)
    assert cancelled in [job["id"] for job in only["jobs"]] and {job["state"] for job in only["jobs"]} == {"cancelled"}
    limited = tula("status", "--limit", "1", "--server", api_only.url)
    lines = limited.stdout.splitlines()
    assert limited.returncode == 0 and len(lines) == 3 and lines[0].startswith("ID ") and lines[2].startswith("(1 of ")


def test_show_lists_the_points_of_a_queued_job(api_only):
    job_id = submit_queued(api_only, batch_sizes=[8, 16])
    shown = tula("show", job_id, "--server", api_only.url)
    assert shown.returncode == 0, shown.stderr
    assert f"job {job_id} (handmade): queued, 0/2 points" in shown.stdout and "now: waiting for a worker" in shown.stdout
    assert [line.split()[:3] for line in shown.stdout.splitlines() if line.split()[:1] in (["8"], ["16"])] == [
        ["8", "queued", "0"], ["16", "queued", "0"],
    ]  # fmt: skip


def test_cancel_then_show_reports_what_was_not_measured_and_delete_removes_it(api_only):
    job_id = submit_queued(api_only, batch_sizes=[8, 16])
    cancelled = tula("cancel", job_id, "--server", api_only.url)
    assert cancelled.returncode == 0 and f"job {job_id}: cancelled (0 of " in cancelled.stdout
    assert "points measured; nothing was measured)" in cancelled.stdout
    shown = tula("show", job_id, "--server", api_only.url)
    assert "not measured: batch 8, 16" in shown.stdout
    assert tula("delete", job_id, "--server", api_only.url).returncode == 0
    gone = tula("show", job_id, "--server", api_only.url)
    assert gone.returncode == 2 and "404" in gone.stderr and "not found" in gone.stderr


def test_show_json_of_a_done_job_has_the_job_and_its_recommendation(done_job):
    server, job_id, _ = done_job
    shown = tula("show", job_id, "--json", "--server", server.url)
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert body["job"]["id"] == job_id and body["job"]["state"] == "done"
    assert [p["batch_size"] for p in body["job"]["points"]][:3] == [8, 16, 32]  # then any measured again
    assert body["recommendation"]["chosen"]["global_batch"] > 0


def test_show_of_a_done_job_prints_points_and_recommendation(done_job):
    server, job_id, _ = done_job
    shown = tula("show", job_id, "--server", server.url)
    assert shown.returncode == 0, shown.stderr
    assert re.search(rf"job {job_id} \(cli-done\): done, (\d+)/\1 points", shown.stdout)
    assert "BATCH  STATE  ATTEMPTS  DURATION" in shown.stdout and "chosen: global batch" in shown.stdout


def test_plan_for_16_gpus_a_price_and_a_deadline(done_job):
    server, job_id, _ = done_job
    planned = tula("plan", job_id, "--gpus", "16", "--price", "3", "--objective", "deadline", "--deadline", "4h",
                   "--server", server.url)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert "cluster.nodes 1 -> 4" in planned.stdout and "devices 4 -> 16" in planned.stdout
    assert "pricing.price 2.5 -> 3" in planned.stdout and "deadline_h - -> 4" in planned.stdout
    assert "objective: deadline" in planned.stdout and "compared with the stored recommendation" in planned.stdout
    as_json = json.loads(tula("plan", job_id, "--gpus", "16", "--deadline", "90m", "--json", "--server", server.url).stdout)
    assert as_json["what_if"] == {"cluster": {"nodes": 4}, "objective": "deadline", "deadline_h": 1.5}
    assert max(row["devices"] for row in as_json["candidates"]) == 16


def test_plan_with_the_jobs_own_values_says_nothing_changes(done_job):
    server, job_id, _ = done_job
    planned = tula("plan", job_id, "--gpus", "4", "--price", "2.5", "--server", server.url)  # 1 node of 4 GPUs, $2.5
    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    assert lines[0] == (f"what-if for job {job_id}: nothing changes (cluster.nodes 1, pricing.price 2.5 are the job's "
                        "values already); the stored spec re-planned")  # fmt: skip
    assert lines[-1].startswith("the same as the stored recommendation: global batch ")
    assert "->" not in planned.stdout


def test_plan_lists_only_the_values_that_change(done_job):
    server, job_id, _ = done_job
    planned = tula("plan", job_id, "--nodes", "1", "--price", "3", "--objective", "knee", "--server", server.url)
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.splitlines()[0] == f"what-if for job {job_id}: pricing.price 2.5 -> 3 (unchanged: cluster.nodes 1, objective knee)"
    compared = planned.stdout.splitlines()[-1]
    assert compared.startswith("compared with the stored recommendation: ") and "cost $" in compared
    assert "devices 4 -> 4" not in compared and "global batch" in compared.split("(unchanged: ")[1]


def test_plan_on_another_gpu_type(done_job):
    server, job_id, _ = done_job
    planned = tula("plan", job_id, "--gpu-type", "h100_sxm", "--server", server.url)
    assert planned.returncode == 0, planned.stderr
    assert "cluster.gpu_type - -> h100_sxm" in planned.stdout and "chosen: global batch" in planned.stdout


def test_plan_with_another_reference_run_and_an_lr_ceiling(done_job):
    server, job_id, _ = done_job
    planned = tula("plan", job_id, "--reference-epochs", "20", "--reference-lr", "0.1", "--max-lr", "0.3", "--json", "--server", server.url)
    assert planned.returncode == 0, planned.stderr
    body = json.loads(planned.stdout)
    assert body["what_if"] == {"training": {"reference_epochs": 20.0, "reference_lr": 0.1, "max_lr": 0.3}}
    assert body["models"]["efficiency"]["max_step_gain"]["value"] == pytest.approx(3.0)
    refused = tula("plan", job_id, "--max-lr", "0.3", "--server", server.url)  # the stored spec has no reference_lr
    assert refused.returncode == 2 and "training" in refused.stderr and "needs reference_lr" in refused.stderr


def test_plan_with_a_run_measured_where_the_answer_said_fits_the_runs(done_job):
    """The run the answer names (models.efficiency.next_run), measured and given back with --other-run: the epochs
    come from the runs now, with the stored noise scale as their prior, and no further run is named."""
    server, job_id, _ = done_job
    stored = json.loads(tula("show", job_id, "--json", "--server", server.url).stdout)["recommendation"]
    batch = stored["models"]["efficiency"]["next_run"]["batch"]
    planned = tula("plan", job_id, "--other-run", f"{batch}:14.5", "--json", "--server", server.url)
    assert planned.returncode == 0, planned.stderr
    body = json.loads(planned.stdout)
    assert body["what_if"] == {"training": {"other_runs": [{"batch": batch, "epochs": 14.5}]}}
    efficiency = body["models"]["efficiency"]
    assert efficiency["noise_scale"]["evidence"] == "other_runs" and efficiency["next_run"] is None
    assert "prior" in efficiency["evidence"]["candidates"][0]["detail"]
    for bad in ("256", "256:0", "x:3", "0:3"):
        refused = tula("plan", job_id, "--other-run", bad, "--server", server.url)
        assert refused.returncode == 2 and "is not BATCH:EPOCHS" in refused.stderr, (bad, refused.stderr)


def test_plan_with_a_reference_runs_statistics_reads_the_noise_scale_from_them(done_job, tmp_path):
    """`tula plan JOB --reference-stats FILE`: the records replace training.reference_run.gradient_stats in the
    what-if, and the noise scale comes from them (falling loss, |G|^2 falling along the run: a run that learns)."""
    server, job_id, _ = done_job
    stats = tmp_path / "stats.jsonl"
    records = [{"samples": 32 * 100 * i, "batch": 32, "grad_sqr": 1.0 / i, "trace_sigma": 40.0, "loss": 2.3 / (1 + 0.1 * i)}
               for i in range(1, 41)]  # fmt: skip
    stats.write_text("".join(json.dumps(r) + "\n" for r in records))
    planned = tula("plan", job_id, "--reference-stats", str(stats), "--json", "--server", server.url)
    assert planned.returncode == 0, planned.stderr
    body = json.loads(planned.stdout)
    assert body["what_if"]["training"]["reference_run"]["gradient_stats"][0]["samples"] == 3200
    assert body["models"]["efficiency"]["noise_scale"]["evidence"] == "reference_run"
    human = tula("plan", job_id, "--reference-stats", str(stats), "--server", server.url)
    assert human.returncode == 0, human.stderr
    assert f"training.reference_run.gradient_stats 0 records -> 40 from {stats}" in human.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"samples": 1, "batch": 32}) + "\n")
    refused = tula("plan", job_id, "--reference-stats", str(bad), "--server", server.url)
    assert refused.returncode == 2 and f"{bad} line 1: 'grad_sqr' is missing" in refused.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--gpus", "6"), "--nodes 2 --gpus-per-node 3"),
        (("--gpus", "8", "--nodes", "3"), "is not --nodes 3 x 4"),
        (("--objective", "deadline"), "objective 'deadline' needs deadline_h"),  # the spec's rule, the server's 409
        (("--deadline", "4h", "--budget", "10"), "--objective deadline|budget"),
    ],
)
def test_plan_mistakes_are_clear_errors(done_job, args, message):
    server, job_id, _ = done_job
    result = tula("plan", job_id, *args, "--server", server.url)
    assert result.returncode == 2 and message in result.stderr


def test_plan_of_a_job_that_is_not_done_says_so(api_only):
    job_id = submit_queued(api_only)
    result = tula("plan", job_id, "--nodes", "2", "--server", api_only.url)
    assert result.returncode == 2 and "409" in result.stderr and "what-if needs its measurements" in result.stderr


@pytest.mark.parametrize(("text", "hours"), [("4h", 4), ("90m", 1.5), ("2.5h", 2.5), ("1d", 24), ("3600s", 1), ("3", 3)])
def test_durations(text, hours):
    assert duration_h(text) == pytest.approx(hours)


@pytest.mark.parametrize("text", ["", "4x", "h", "-1h", "0", "4 hours"])
def test_bad_durations_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        duration_h(text)


def test_bad_duration_on_the_command_line_exits_2():
    result = tula("plan", "abc", "--deadline", "soon", "--server", "http://127.0.0.1:9")
    assert result.returncode == 2 and "'soon' is not a duration" in result.stderr


def test_ray_address_needs_the_ray_executor(tmp_path):
    result = tula("serve", "--ray-address", "ray://x:10001", "--database-url", f"sqlite:///{tmp_path / 't.db'}")
    assert result.returncode == 2 and "--ray-address needs --executor ray" in result.stderr


def test_an_unreliable_recommendation_is_said_first_and_the_knee_method_in_words():
    from tests.handmade import measurement
    from tula_service.cli.printing import format_recommendation
    from tula_service.plan.recommend import plan
    from tula_service.spec.job_spec import JobSpec

    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64]))
    points = [measurement(b) for b in (8, 16, 32, 64)]
    for point in points:
        point["iter_time"] = {**point["iter_time"], "cv": 0.9}
    text = format_recommendation(plan(spec, points))
    assert text.splitlines()[0] == "WARNING: unreliable: re-profile on a quiet host"
    assert "4 of 4 points have iteration-time CVs above 25%" in text.splitlines()[1]
    rec = plan(spec, [measurement(b) for b in (8, 16, 32, 64)])
    clean = format_recommendation(rec)
    assert not clean.startswith("WARNING") and f"  {rec['knee']['method']}: {rec['knee']['method_explained']}" in clean


def test_a_pick_at_the_edge_of_the_search_is_said_under_the_chosen_configuration():
    from tests.handmade import measurement
    from tula_service.cli.printing import format_recommendation
    from tula_service.plan.recommend import plan
    from tula_service.spec.job_spec import JobSpec

    spec = JobSpec.model_validate(spec_dict(objective="min_time"))
    rec = plan(spec, [measurement(b, beta_s_per_sample=1e-6) for b in (8, 16, 32, 64, 128)])
    lines = format_recommendation(rec).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  at the edge of the search: "))
    assert lines[at] == f"  at the edge of the search: {rec['search_space']['chosen_at_edge']['why']}"
    assert lines[at - 1].startswith("  ") and any(line.startswith("chosen: ") for line in lines[:at])


def test_the_recommendation_shows_the_noise_scale_its_evidence_and_its_caveats():
    from tests.handmade import measurement
    from tula_service.cli.human import human_duration, human_number
    from tula_service.cli.printing import format_recommendation
    from tula_service.fit.efficiency_evidence import ASSUMED_LR, MOMENTUM_CAVEAT
    from tula_service.plan.advice import LR_STABILITY_ASSUMED
    from tula_service.plan.recommend import plan
    from tula_service.spec.job_spec import JobSpec

    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64]))
    rec = plan(spec, [measurement(b) for b in (8, 16, 32, 64)])
    lines = format_recommendation(rec).splitlines()
    line = next(line for line in lines if line.startswith("  noise scale B_noise"))
    calibrated = rec["models"]["efficiency"]["noise_scale"]["calibrated_interval"]
    low, high = (human_number(v) for v in calibrated["value"])
    assert line == f"  noise scale B_noise 100 from initialization (weak evidence); 80% interval {low}-{high} ({calibrated['why']})"
    epochs, time = rec["chosen"]["epochs"]["calibrated_interval"], rec["chosen"]["total_time_s"]["calibrated_interval"]
    assert (f"  80% interval: epochs {human_number(epochs[0])}-{human_number(epochs[1])}, total time {human_duration(time[0])}-"
            f"{human_duration(time[1])} (the epochs model's error measured across tasks; see B_noise below)") in lines
    assert f"    - {MOMENTUM_CAVEAT}" in lines and any("grows 10-1000x" in line for line in lines)
    assert f"  epochs assume: {ASSUMED_LR['advised_rule']}" in lines
    with pytest.MonkeyPatch.context() as env:  # a fine-tuning job's points start from its checkpoint, and the line says so
        env.setenv("TULA_DATA_ROOTS", "/data")
        tuned = plan(JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64], initial_weights="/data/w.pt")),
                     [measurement(b) for b in (8, 16, 32, 64)])  # fmt: skip
    started = next(line for line in format_recommendation(tuned).splitlines() if line.startswith("  noise scale B_noise"))
    assert started.startswith("  noise scale B_noise 100 from initialization, started from initial_weights /data/w.pt (weak evidence)")
    run = rec["models"]["efficiency"]["next_run"]  # 8 x the reference batch 32
    assert run["batch"] == 256 and (f"  to settle the epochs: measure a run at global batch 256 to the same target and give its "
                                    f"epochs as training.other_runs (predicted now: {human_number(run['predicted_epochs'])} epochs "
                                    f"(80%: {human_number(run['predicted_epochs_interval'][0])}-"
                                    f"{human_number(run['predicted_epochs_interval'][1])}); tula plan JOB --other-run 256:EPOCHS)") in lines  # fmt: skip
    assert f"    - LR stability {LR_STABILITY_ASSUMED}" not in lines  # the chosen batch is the reference: the LR is not raised
    small_reference = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64], training={"reference_batch": 8}))
    raised = format_recommendation(plan(small_reference, [measurement(b) for b in (8, 16, 32, 64)])).splitlines()
    assert f"    - LR stability {LR_STABILITY_ASSUMED}" in raised
    assert ("    - sgd settings assumed (training.<name>; profiling, the pilot and the advice use them): momentum 0.9, nesterov false, "
            "dampening 0, weight_decay 0") in raised  # fmt: skip
    stats = [{"samples": 25_000 * (i + 1), "batch": 32, "grad_sqr": 1.0, "trace_sigma": 400.0 + 10 * i} for i in range(20)]
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64], training={"reference_run": {"gradient_stats": stats}}))
    line = next(line for line in format_recommendation(plan(spec, [measurement(b) for b in (8, 16, 32, 64)])).splitlines()
                if line.startswith("  noise scale B_noise"))  # fmt: skip
    assert "from reference run; 80% interval " in line
    low, high = (human_number(v) for v in plan(spec, [measurement(b) for b in (8, 16, 32, 64)])["models"]["efficiency"]["noise_scale"]["interval"])
    assert f" [{low}-{high}] from reference run" in line  # one separator: a thousands' comma must not read as a third number


def test_a_raised_lr_capped_by_a_measured_headroom_says_so():
    from tests.handmade import measurement
    from tula_service.cli.human import human_number
    from tula_service.cli.printing import format_recommendation
    from tula_service.plan.recommend import plan
    from tula_service.spec.job_spec import JobSpec

    stats = [{"samples": 25_000 * (i + 1), "batch": 8, "grad_sqr": 1.0, "trace_sigma": 400.0} for i in range(20)]
    stats[-1]["stability_headroom"] = 1.3
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64], objective="min_time",
                                            training={"reference_batch": 8, "reference_run": {"gradient_stats": stats}}))  # fmt: skip
    rec = plan(spec, [measurement(b) for b in (8, 16, 32, 64)])
    assert rec["training_advice"]["lr_rule"]["batch_ratio_k"] > 1  # the chosen batch is above the reference
    lines = format_recommendation(rec).splitlines()
    stability = next(line for line in lines if line.startswith("    - LR stability"))
    assert stability.startswith("    - LR stability measured: never above 1.3x the reference LR")
    assert any(line.startswith("  LR x1.30 (adascale, fitted)") for line in lines)
    low, high = rec["chosen"]["epochs"]["interval"]  # the chosen batch's LR is capped: its epochs carry the cap's interval
    assert f"  epochs with the LR capped: {human_number(low)}-{human_number(high)} (no cost from the cap to the quadratic model's; the value is their geometric middle)" in lines

"""The pilot point: real training at the reference batch on CPU, with gradient statistics along the way,
run in-process, as the child process the server runs, and end to end through the store and executor."""

import json
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from profiler.pilot import StepStats, run_pilot, settled, split_batch, warmup_steps_for  # noqa: E402
from tests.handmade import spec_dict  # noqa: E402
from tests.processes import run_until_finished, submit  # noqa: E402
from tula_service.dispatch.dispatcher import inferred_oom  # noqa: E402
from tula_service.dispatch.executor import LocalExecutor  # noqa: E402
from tula_service.dispatch.jobs import pilot_request, point_request  # noqa: E402
from tula_service.spec.job_spec import GradientStatsRecord, JobSpec  # noqa: E402
from tula_service.store.db import Job, Point  # noqa: E402

IMAGES = {"name": "synthetic_images", "channels": 3, "image_size": 16, "num_classes": 10, "num_samples": 2000}
MNIST1D = {"name": "mnist1d", "num_samples": 2000}


def _pilot(model: str, dataset: dict, batch_size: int, **extra) -> dict:
    request = {"model": model, "dataset": dataset, "batch_size": batch_size, "device": "cpu", "threads": 1, **extra}
    return run_pilot(request)


class OffsetBias(nn.Module):
    """Logits = a learnable bias, 4 nats towards class 0, whatever the input. Its per-sample gradient is
    softmax(bias) - onehot(label): a large mean and a fixed spread, so at a tiny LR the noise scale is
    constant (about 1.4 samples) and well resolved at a batch of 64."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_classes))
        self.bias.data[0] = 4.0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(inputs.shape[0], -1)


def offset_bias(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return OffsetBias(num_classes)


def _assert_contract(records: list[dict], batch: int) -> None:
    for record in records:
        GradientStatsRecord.model_validate(record)  # the shared contract, strict: no extra keys
        assert record["batch"] == batch and record["metric"] is None
        assert record["samples"] == record["step"] * batch
    samples = [r["samples"] for r in records]
    assert samples == sorted(samples) and len(set(samples)) == len(samples)


def test_small_cnn_pilot_trains_its_step_budget_and_records_every_few_steps():
    pilot = _pilot("small_cnn", IMAGES, 16, pilot_steps=30, pilot_record_every=10, grad_microbatches=4)
    assert pilot["status"] == "ok" and pilot["kind"] == "pilot" and pilot["stopped_by"] == "steps"
    assert pilot["steps"] == 30 and pilot["samples"] == 30 * 16 and pilot["batch_size"] == 16
    assert [r["step"] for r in pilot["trajectory"]] == [10, 20, 30]
    assert all(r["window_steps"] == 10 for r in pilot["trajectory"])
    _assert_contract(pilot["trajectory"], 16)
    first = pilot["trajectory"][0]
    assert first["trace_sigma"] > 0 and math.isfinite(first["grad_sqr"]) and first["variability"] > 0
    assert first["precond_grad_sqr"] is None and first["precond_trace_sigma"] is None  # SGD: no preconditioner
    assert pilot["lr"] == {"value": 0.01, "source": "assumed"} and pilot["optimizer"] == "sgd"
    assert pilot["warmup_steps"] == warmup_steps_for(30) == 3
    assert pilot["gradient"]["micro_batches"] == 4 and pilot["gradient"]["micro_batch"] == 4
    assert pilot["threads"] == 1 and pilot["host_load"]["cores"] >= 1 and pilot["elapsed_s"] >= pilot["train_seconds"]
    stability = pilot["stability"]  # measured once, at the last weights, into the last record only
    assert stability["batch"] == 16 and stability["lr"] == 0.01 and stability["sharpness"] > 0
    assert stability["stability_headroom"] == pytest.approx(3.8 / (0.01 * stability["sharpness"]))  # momentum 0.9
    assert pilot["trajectory"][-1]["stability_headroom"] == stability["stability_headroom"]
    assert pilot["trajectory"][-1]["stability_lr"] == 0.01  # after the warm-up: the reference LR
    assert all("stability_headroom" not in r for r in pilot["trajectory"][:-1])
    assert pilot["optimizer_settings"] == {"momentum": {"value": 0.9, "source": "assumed"}, "nesterov": {"value": False, "source": "assumed"},
                                           "dampening": {"value": 0, "source": "assumed"}, "weight_decay": {"value": 0.0, "source": "assumed"}}  # fmt: skip


def test_a_plain_sgd_pilot_trains_without_momentum_and_its_threshold_is_two_over_the_lr():
    pilot = _pilot("small_cnn", IMAGES, 16, pilot_steps=20, pilot_record_every=10, optimizer_settings={"momentum": 0.0},
                   optimizer_setting_sources={"momentum": "spec"})  # fmt: skip
    assert pilot["status"] == "ok" and pilot["optimizer_settings"]["momentum"] == {"value": 0.0, "source": "spec"}
    stability = pilot["stability"]  # plain SGD: lambda_max < 2 / eta
    assert stability["stability_headroom"] == pytest.approx(2.0 / (0.01 * stability["sharpness"]))


def test_a_pilot_trains_with_nesterov_momentum_and_weight_decay_and_its_threshold_is_nesterovs():
    settings = {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    pilot = _pilot("small_cnn", IMAGES, 16, pilot_steps=20, pilot_record_every=10, optimizer_settings=settings,
                   optimizer_setting_sources={"nesterov": "spec", "weight_decay": "spec"})  # fmt: skip
    assert pilot["status"] == "ok" and pilot["optimizer_settings"] == {
        "momentum": {"value": 0.9, "source": "assumed"}, "nesterov": {"value": True, "source": "spec"},
        "dampening": {"value": 0, "source": "assumed"}, "weight_decay": {"value": 5e-4, "source": "spec"}}  # fmt: skip
    stability = pilot["stability"]  # Nesterov: lambda_max (of H + wd I) < (2 + 2 beta) / ((1 + 2 beta) eta)
    assert stability["stability_headroom"] == pytest.approx(3.8 / 2.8 / (0.01 * stability["sharpness"]))
    with pytest.raises(ValueError, match="not known"):
        _pilot("small_cnn", IMAGES, 16, pilot_steps=2, optimizer_settings={"maximize": True})


def test_a_pilot_trains_with_dampened_momentum_and_its_threshold_is_divided_by_one_less_the_dampening():
    pilot = _pilot("small_cnn", IMAGES, 16, pilot_steps=20, pilot_record_every=10, optimizer_settings={"momentum": 0.9, "dampening": 0.5},
                   optimizer_setting_sources={"dampening": "spec"})  # fmt: skip
    assert pilot["status"] == "ok" and pilot["optimizer_settings"]["dampening"] == {"value": 0.5, "source": "spec"}
    stability = pilot["stability"]  # heavy ball, dampened: lambda_max < (2 + 2 beta) / ((1 - d) eta)
    assert stability["stability_headroom"] == pytest.approx(3.8 / 0.5 / (0.01 * stability["sharpness"]))


def test_cnn1d_pilot_with_adam_records_the_preconditioned_pair_and_the_loss_falls():
    pilot = _pilot("cnn1d", MNIST1D, 32, optimizer="adam", lr=3e-3, pilot_steps=60, pilot_record_every=20)
    assert pilot["status"] == "ok" and pilot["lr"] == {"value": 3e-3, "source": "spec"}
    records = pilot["trajectory"]
    _assert_contract(records, 32)
    for record in records:
        assert math.isfinite(record["precond_grad_sqr"]) and record["precond_trace_sigma"] > 0
    assert records[-1]["loss"] < records[0]["loss"]  # it trains: the statistics are taken along training
    headroom = pilot["stability"]["stability_headroom"]  # Adam: (2 + 2 beta1) (1 - beta1^t) / (1 - beta1) / (eta lambda_max), t = 61
    assert headroom == pytest.approx(38.0 * (1 - 0.9**61) / (3e-3 * pilot["stability"]["sharpness"])) and records[-1]["stability_headroom"] == headroom


def test_cnn1d_pilot_with_rmsprop_records_its_preconditioned_pair_and_its_headroom():
    pilot = _pilot("cnn1d", MNIST1D, 32, optimizer="rmsprop", lr=1e-3, pilot_steps=40, pilot_record_every=20)
    assert pilot["status"] == "ok"
    records = pilot["trajectory"]
    _assert_contract(records, 32)
    assert all(math.isfinite(r["precond_grad_sqr"]) and r["precond_trace_sigma"] > r["trace_sigma"] for r in records)
    headroom = pilot["stability"]["stability_headroom"]  # RMSprop without momentum: 2 / (eta lambda_max), preconditioned
    assert headroom == pytest.approx(2.0 / (1e-3 * pilot["stability"]["sharpness"])) and records[-1]["stability_headroom"] == headroom


def test_an_rmsprop_pilot_trains_with_the_specs_momentum_and_its_threshold_has_it():
    pilot = _pilot("cnn1d", MNIST1D, 32, optimizer="rmsprop", lr=1e-4, optimizer_settings={"momentum": 0.9},
                   optimizer_setting_sources={"momentum": "spec"}, pilot_steps=40, pilot_record_every=20)  # fmt: skip
    assert pilot["status"] == "ok" and pilot["optimizer_settings"]["momentum"] == {"value": 0.9, "source": "spec"}
    headroom = pilot["stability"]["stability_headroom"]  # RMSprop with momentum 0.9: (2 + 2 x 0.9) / (eta lambda_max), preconditioned
    assert headroom == pytest.approx(3.8 / (1e-4 * pilot["stability"]["sharpness"]))
    plain = _pilot("cnn1d", MNIST1D, 32, optimizer="rmsprop", lr=1e-4, pilot_steps=2, pilot_record_every=2)
    assert plain["optimizer_settings"]["momentum"] == {"value": 0.0, "source": "assumed"}  # PyTorch's default


def test_an_adam_pilot_trains_with_the_specs_betas():
    """The same pilot (seed, batches) with beta2 0.95 and with PyTorch's 0.999: the preconditioned records differ, so the
    betas reached the optimizer; the threshold stays (2 + 2 beta1) (1 - beta1^t) / (1 - beta1) = 38 (1 - 0.9^61) at beta1
    0.9, for its 61st step."""
    options = {"optimizer": "adam", "lr": 3e-3, "pilot_steps": 60, "pilot_record_every": 20}
    pilot = _pilot("cnn1d", MNIST1D, 32, optimizer_settings={"betas": [0.9, 0.95]}, optimizer_setting_sources={"betas": "spec"}, **options)
    settings = pilot["optimizer_settings"]
    assert pilot["status"] == "ok" and settings["betas"] == {"value": [0.9, 0.95], "source": "spec"} and "momentum" not in settings
    headroom = pilot["stability"]["stability_headroom"]
    assert headroom == pytest.approx(38.0 * (1 - 0.9**61) / (3e-3 * pilot["stability"]["sharpness"]))
    default = _pilot("cnn1d", MNIST1D, 32, **options)
    assert default["optimizer_settings"]["betas"] == {"value": [0.9, 0.999], "source": "assumed"}  # PyTorch's
    assert [r["precond_grad_sqr"] for r in pilot["trajectory"]] != [r["precond_grad_sqr"] for r in default["trajectory"]]
    assert set(default["optimizer_settings"]) == {"betas", "eps", "amsgrad", "weight_decay"}  # the spec's for adam, no more


def test_an_adafactor_pilot_reports_its_weight_decay_alone_and_gradient_descents_edge_with_its_decoupled_decay():
    """Adafactor's eps pair is PyTorch's, not the spec's eps (profiler.measure); its precond pair from the second step
    on; its edge 2 / eta on its preconditioned Hessian, its decay decoupled (profiler.sharpness)."""
    pilot = _pilot("cnn1d", MNIST1D, 32, optimizer="adafactor", optimizer_settings={"weight_decay": 0.01},
                   optimizer_setting_sources={"weight_decay": "spec"}, lr=1e-2, pilot_steps=30, pilot_record_every=10)
    assert pilot["status"] == "ok" and pilot["optimizer_settings"] == {"weight_decay": {"value": 0.01, "source": "spec"}}
    assert all(r["precond_grad_sqr"] is not None for r in pilot["trajectory"][1:])
    stability = pilot["stability"]
    assert stability["stability_headroom"] == pytest.approx(2.0 / (1e-2 * (stability["sharpness"] + 2.0 * 0.01 / 2)), rel=1e-3)


def test_nadam_and_radam_pilots_report_the_settings_the_spec_has_for_them_and_record_the_preconditioned_pair():
    options = {"lr": 2e-3, "pilot_steps": 30, "pilot_record_every": 10}
    nadam = _pilot("cnn1d", MNIST1D, 32, optimizer="nadam", optimizer_settings={"momentum_decay": 0.01, "decoupled_weight_decay": True,
                   "weight_decay": 0.01}, optimizer_setting_sources={"momentum_decay": "spec", "decoupled_weight_decay": "spec"}, **options)  # fmt: skip
    assert nadam["status"] == "ok" and set(nadam["optimizer_settings"]) == {"betas", "eps", "momentum_decay", "decoupled_weight_decay", "weight_decay"}
    assert nadam["optimizer_settings"]["momentum_decay"] == {"value": 0.01, "source": "spec"}
    assert nadam["optimizer_settings"]["decoupled_weight_decay"] == {"value": True, "source": "spec"}
    radam = _pilot("cnn1d", MNIST1D, 32, optimizer="radam", **options)
    assert radam["status"] == "ok" and set(radam["optimizer_settings"]) == {"betas", "eps", "decoupled_weight_decay", "weight_decay"}
    for pilot in (nadam, radam):
        assert all(r["precond_grad_sqr"] is not None for r in pilot["trajectory"][1:]), pilot["optimizer_settings"]
    # NAdam's edge at its coming step (profiler.sharpness), decoupled decay as AdamW's: c / (eta (lambda + c wd / 2))
    mu = [0.9 * (1 - 0.5 * 0.96 ** (t * 0.01)) for t in range(1, 33)]  # mu_1 .. mu_32; the pilot took 30 steps
    product = math.prod(mu[:31])
    c1, c2 = (1 - mu[30]) / (1 - product), mu[31] / (1 - product * mu[31])
    threshold_times_lr = 3.8 / (c1 * 1.9 + c2 * 0.1)
    stability = nadam["stability"]
    assert stability["stability_headroom"] == pytest.approx(threshold_times_lr / (2e-3 * (stability["sharpness"] + threshold_times_lr * 0.01 / 2)), rel=1e-3)


def test_pilot_stops_at_its_time_budget():
    pilot = _pilot("small_cnn", IMAGES, 16, pilot_steps=100_000, pilot_seconds=0.5, pilot_record_every=5)
    assert pilot["stopped_by"] == "seconds" and 0 < pilot["steps"] < 100_000
    assert 0.5 <= pilot["train_seconds"] < 0.5 + 1.0  # at most one step past the budget
    _assert_contract(pilot["trajectory"], 16)  # the last, partial window is kept
    assert pilot["trajectory"][-1]["step"] == pilot["steps"]


def test_settle_rule_fires_where_the_noise_scale_is_constant():
    pilot = _pilot(
        "tests.test_pilot:offset_bias", IMAGES, 64, allowed_model_modules=["tests.test_pilot"], lr=1e-5,
        grad_microbatches=8, pilot_steps=300, pilot_record_every=20,
    )  # fmt: skip
    assert pilot["stopped_by"] == "settled" and pilot["steps"] < 300
    noise_scales = [r["trace_sigma"] / r["grad_sqr"] for r in pilot["trajectory"]]
    assert all(1.0 < b < 2.0 for b in noise_scales)


def _steps(grad_sqr: float, trace_sigma: float, count: int = 10, spread: float = 0.0) -> list[StepStats]:
    """Per-step estimates alternating +-spread around the given means."""
    signs = [1 if i % 2 else -1 for i in range(count)]
    return [StepStats(1.0, grad_sqr * (1 + s * spread), trace_sigma * (1 - s * spread), 1.0) for s in signs]


def _records(noise_scales: list[float], window_steps: int = 10) -> list[dict]:
    return [
        {"grad_sqr": 1.0, "trace_sigma": b, "step": (i + 1) * window_steps, "window_steps": window_steps}
        for i, b in enumerate(noise_scales)
    ]


def test_settle_rule_needs_steady_precise_estimates_after_the_warm_up():
    steady = [_steps(1.0, 100.0, spread=0.01)] * 4
    assert settled(_records([100, 101, 100, 102]), steady, warmup_steps=0)
    assert not settled(_records([100, 101, 100, 102]), steady, warmup_steps=20)  # only 2 records after it
    assert not settled(_records([100, 120, 95, 100]), steady, warmup_steps=0)  # up and back: 25% in total
    noisy = [_steps(1.0, 100.0, spread=0.9)] * 4  # steady values, but the estimate cannot resolve 10%
    assert not settled(_records([100, 101, 100, 101]), noisy, warmup_steps=0)
    assert not settled(_records([100, 101, -50, 101]), steady, warmup_steps=0)  # |G|^2 unresolved


def test_settle_rule_on_records_that_change_by_a_little_under_ten_percent_in_total():
    steady = [_steps(1.0, 100.0, spread=0.01)] * 3
    assert settled(_records([100, 104, 100]), steady, warmup_steps=0)  # 4% + 3.8%
    assert not settled(_records([100, 106, 100]), steady, warmup_steps=0)  # 6% + 5.7%


def test_a_diverging_loss_ends_the_pilot_with_what_it_has():
    pilot = _pilot("cnn1d", MNIST1D, 16, lr=1e4, pilot_steps=100, pilot_record_every=5)
    assert pilot["status"] == "ok" and pilot["stopped_by"] == "diverged" and pilot["steps"] < 100
    assert "diverged" in pilot and pilot["diverged"]["step"] == pilot["steps"] + 1
    assert pilot["stability"] is None  # no headroom is read off weights that diverged
    _assert_contract(pilot["trajectory"], 16)


def test_batch_split_into_equal_micro_batches_of_at_least_two():
    assert split_batch(32, 4) == (4, 8)
    assert split_batch(6, 4) == (3, 2)
    assert split_batch(10, 8) == (5, 2)
    assert split_batch(13, 4) == (4, 3)  # prime: the remainder is dropped and the record says 12
    with pytest.raises(ValueError, match="at least 4 samples"):
        split_batch(3, 4)


def test_pilot_out_of_memory_in_the_child_process_is_data(tmp_path):
    # Micro-batches of 1024 x 32x32 images need ~350 MB of activations; the child may use 64 MiB more.
    request = {
        "kind": "pilot", "model": "small_cnn", "dataset": {**IMAGES, "image_size": 32}, "batch_size": 4096,
        "device": "cpu", "threads": 1, "pilot_steps": 10, "memory_limit_bytes": 64 * 2**20,
    }  # fmt: skip
    out = tmp_path / "pilot.json"
    result = subprocess.run(
        [sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["kind"] == "pilot" and record["status"] == "oom" and "allocate" in record["error"]
    assert record["trajectory"] == []


def test_a_job_gets_a_pilot_point_at_the_reference_batch_only_when_asked(store):
    with_pilot = submit(store, batch_sizes=[8, 16], profiling={"pilot": True})
    assert [(p.kind, p.batch_size) for p in with_pilot.points] == [("grid", 8), ("grid", 16), ("pilot", 32)]
    assert all(p.kind != "pilot" for p in submit(store, name="no-pilot", batch_sizes=[8, 16]).points)


def test_pilot_request_carries_the_budget_the_lr_and_its_source():
    spec = JobSpec.model_validate(spec_dict(
        training={"optimizer": "adamw", "reference_lr": 0.002},
        profiling={"pilot": True, "pilot_steps": 50, "pilot_seconds": 5, "pilot_record_every": 5, "threads": 1},
    ))  # fmt: skip
    request = pilot_request(spec)
    assert request["kind"] == "pilot" and request["batch_size"] == 32 and request["optimizer"] == "adamw"
    assert (request["lr"], request["lr_source"]) == (0.002, "spec") and request["threads"] == 1
    assert (request["pilot_steps"], request["pilot_seconds"], request["pilot_record_every"]) == (50, 5, 5)
    assumed = pilot_request(JobSpec.model_validate(spec_dict(profiling={"pilot": True})))
    assert (assumed["lr"], assumed["lr_source"]) == (0.01, "assumed")

    def setting(request, name):
        return request["optimizer_settings"].get(name), request["optimizer_setting_sources"].get(name)

    assert setting(request, "momentum") == (None, None)  # AdamW has no SGD momentum
    assert setting(request, "weight_decay") == (0.01, "assumed")  # AdamW's PyTorch default
    assert setting(assumed, "momentum") == (0.9, "assumed") and setting(assumed, "nesterov") == (False, "assumed")
    plain = pilot_request(JobSpec.model_validate(spec_dict(training={"momentum": 0}, profiling={"pilot": True})))
    assert setting(plain, "momentum") == (0.0, "spec")
    rmsprop = pilot_request(JobSpec.model_validate(spec_dict(training={"optimizer": "rmsprop", "momentum": 0.9, "centered": True},
                                                             profiling={"pilot": True})))  # fmt: skip
    assert setting(rmsprop, "momentum") == (0.9, "spec") and setting(rmsprop, "centered") == (True, "spec")
    rmsprop = pilot_request(JobSpec.model_validate(spec_dict(training={"optimizer": "rmsprop"}, profiling={"pilot": True})))
    assert setting(rmsprop, "momentum") == (0.0, "assumed") and setting(rmsprop, "alpha") == (0.99, "assumed")  # PyTorch's defaults
    adamw = pilot_request(JobSpec.model_validate(spec_dict(training={"optimizer": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1},
                                                           profiling={"pilot": True})))  # fmt: skip
    assert setting(adamw, "betas") == ([0.9, 0.95], "spec") and setting(request, "betas") == ([0.9, 0.999], "assumed")
    assert setting(adamw, "weight_decay") == (0.1, "spec") and setting(assumed, "betas") == (None, None)  # SGD has none
    eps = point_request(JobSpec.model_validate(spec_dict(training={"optimizer": "adamw", "eps": 1e-6})), 64)["optimizer_settings"]
    assert eps == {"betas": [0.9, 0.999], "eps": 1e-6, "amsgrad": False, "weight_decay": 0.01}  # all of them: PyTorch's where not given


def test_an_out_of_memory_is_never_inferred_for_or_from_a_pilot():
    pilot_oom = Point(id=1, kind="pilot", batch_size=32, state="oom")
    grid = Point(id=2, kind="grid", batch_size=64, state="queued")
    assert inferred_oom(Job(points=[pilot_oom, grid]), grid) is None
    grid_oom = Point(id=3, kind="grid", batch_size=16, state="oom")
    pilot = Point(id=4, kind="pilot", batch_size=32, state="queued")
    assert inferred_oom(Job(points=[grid_oom, pilot]), pilot) is None
    assert inferred_oom(Job(points=[grid_oom, grid]), grid).state == "oom"  # compute points still are


@pytest.mark.e2e
def test_a_job_with_a_pilot_ends_done_with_its_trajectory_and_threads_reach_the_child(store):
    profiling = {
        "time_cap_s": 0.2, "timed_iters": 2, "warmup_iters": 1, "grad_iters": 2, "threads": 1,
        "pilot": True, "pilot_steps": 20, "pilot_record_every": 5,
    }  # fmt: skip
    job = submit(store, batch_sizes=[8, 16], dataset={"name": "synthetic_images", "num_samples": 2000}, profiling=profiling)
    finished = run_until_finished(store, LocalExecutor(store, poll_s=0.05), job.id, timeout_s=120)
    assert finished.state == "done", finished.error
    [pilot] = [p for p in finished.points if p.kind == "pilot"]
    assert pilot.state == "done" and pilot.attempts == 1 and pilot.batch_size == 32
    measurement = pilot.measurement
    assert measurement["kind"] == "pilot" and measurement["steps"] == 20 and len(measurement["trajectory"]) == 4
    _assert_contract(measurement["trajectory"], 32)
    assert measurement["threads"] == 1 and measurement["threads_source"] == "spec"
    assert all(p.measurement["threads"] == 1 for p in finished.points if p.kind == "grid")
    assert finished.recommendation["profiled"]["failed"] == []  # planned from the compute points as before


def test_a_stability_measurement_that_fails_is_reported_and_the_pilot_keeps_its_records(monkeypatch):
    import profiler.pilot as pilot_module

    def no_second_derivative(*args, **kwargs):
        raise RuntimeError("derivative for some_kernel_backward is not implemented")

    monkeypatch.setattr(pilot_module, "stability_headroom", no_second_derivative)
    pilot = _pilot("small_cnn", IMAGES, 16, pilot_steps=20, pilot_record_every=10)
    assert pilot["status"] == "ok" and [r["step"] for r in pilot["trajectory"]] == [10, 20]
    assert "not implemented" in pilot["stability"]["error"] and all("stability_headroom" not in r for r in pilot["trajectory"])


@pytest.mark.parametrize(("optimizer", "lr"), [("adam", 1e-3), ("adamax", 1e-3), ("adagrad", 1e-3), ("adafactor", 1e-6)])
def test_a_pilot_steps_precond_pair_weighs_by_the_p_the_step_divides_by(optimizer, lr):
    """accumulated_step on a real Trainer against an oracle: P read from the optimizer's state right after the step
    (what it divided by), the same micro-batches by their own autograd.grad. The MLP's inputs are 0 in feature 5 for
    three steps, so its first-layer weights there keep a second moment of 0 until the feature turns on: P read before
    the step counted them at 1 / eps. Adafactor's P scales with its parameters' RMS, read after the step here and
    before it by the pilot: its LR is small enough that the step leaves the RMS as it was to 1e-6."""
    from models.workload import build_workload
    from profiler.gradstats import two_batch_estimates
    from profiler.measure import Trainer
    from profiler.pilot import accumulated_step
    from profiler.preconditioner import preconditioner

    torch.manual_seed(0)
    request = {"model": "mlp1d", "dataset": MNIST1D, "batch_size": 16, "device": "cpu", "optimizer": optimizer, "lr": lr}
    workload = build_workload(request)
    trainer = Trainer(workload, request, torch.device("cpu"))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(3)
    for step in range(6):
        inputs, targets = workload.data.batch(16, generator)
        if step < 3:
            inputs = inputs.clone()
            inputs[..., 5] = 0.0
        micro = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(workload.loss_fn(trainer.model(x), y), params)]).double()
                 for x, y in zip(inputs.chunk(4), targets.chunk(4))]  # fmt: skip
        stats = accumulated_step(trainer, inputs, targets, microbatches=4, micro_batch=4, precondition=True)
        if step == 0:
            assert stats.precond_grad_sqr is None  # no second moment before the first step
            continue
        scale = preconditioner(trainer.optimizer, params).double()
        full = torch.stack(micro).mean(0)
        expected = two_batch_estimates([float(((g * scale) ** 2).sum()) for g in micro], float(((full * scale) ** 2).sum()), 4, 16)
        assert stats.precond_trace_sigma == pytest.approx(expected[1], rel=1e-4)
        assert stats.precond_grad_sqr == pytest.approx(expected[0], rel=1e-4, abs=1e-4 * abs(expected[1]))

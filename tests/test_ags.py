"""The AGS runtime: the decision rule, DDP and accumulation equivalence, checkpoints, AMP, the config loader."""

import contextlib
import copy
import json
import math

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from profiler.ags import AdaptiveGradientScaler, AGSOptimizer, config_values  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.gloo_ranks import gloo_group, spawn_ranks  # noqa: E402
from tests.handmade import measurement, spec_dict  # noqa: E402

torch.set_num_threads(1)

BATCH = 32
STEPS = 8
DELTA = 0.2  # between the variabilities of the tiny run below: some steps are scaled, some are not
SCALE = 2.0


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)) for _ in range(steps)]


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def _run(model, optimizer, ags, batches, micro_batches: int = 1, part: slice = slice(None)):
    """SGD steps on `batches` (rows `part` of each), each as `micro_batches` accumulated pieces;
    returns per step (decision, gradients after the decision)."""
    record = []
    for inputs, targets in batches:
        inputs, targets = inputs[part], targets[part]
        optimizer.zero_grad(set_to_none=True)
        for chunk_in, chunk_t in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
            (F.cross_entropy(model(chunk_in), chunk_t) / micro_batches).backward()
        decision = ags.step_scale(optimizer)
        record.append((decision, _flat_grads(model)))
        optimizer.step()
    return record


def _reference_run(micro_batches: int = 1, **ags_options):
    model = _tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ags = AdaptiveGradientScaler(optimizer, delta=DELTA, s=SCALE, **ags_options)
    return _run(model, optimizer, ags, _batches(), micro_batches), model


def _set_grad(param: nn.Parameter, values: list[float]) -> None:
    param.grad = torch.tensor(values)


# -- the decision rule ------------------------------------------------------------------------------


def test_scales_by_s_exactly_when_the_variability_is_below_delta():
    param = nn.Parameter(torch.zeros(2))
    ags = AdaptiveGradientScaler(delta=0.25, s=3.0)
    # norms 4, 4.5 (v = 1/8 < 1/4: scaled), 9 (v = 1: not), 6.75 (v = 1/4 = delta: not), 6.75 (v = 0: scaled)
    grads = [[0.0, 4.0], [0.0, 4.5], [0.0, 9.0], [0.0, 6.75], [6.75, 0.0]]
    expected = [(None, False), (0.125, True), (1.0, False), (0.25, False), (0.0, True)]
    for values, (variability, scaled) in zip(grads, expected):
        _set_grad(param, values)
        decision = ags.step_scale([param])
        assert (decision.variability, decision.scaled) == (variability, scaled)
        assert param.grad.tolist() == [v * (3.0 if scaled else 1.0) for v in values]
        assert decision.factor == (3.0 if scaled else 1.0)
    assert ags.metrics() == {
        "steps": 5, "scaled_steps": 2, "scaled_fraction": 0.4, "skipped_steps": 0,
        "last_norm": 6.75, "last_variability": 0.0, "smoothed_variability": 0.0,
    }  # fmt: skip


def test_the_norm_is_global_over_all_parameters():
    first, second = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    _set_grad(first, [3.0])
    _set_grad(second, [4.0])
    assert AdaptiveGradientScaler(delta=0.5, s=2.0).step_scale([first, second]).grad_norm == 5.0


def test_smoothing_compares_an_ema_of_the_variability_with_delta():
    param = nn.Parameter(torch.zeros(1))
    ags = AdaptiveGradientScaler(delta=0.3, s=2.0, smoothing=0.5)
    # v = 0.5, 0.0, 0.0 -> EMA 0.5 (not scaled), 0.25 (scaled), 0.125 (scaled); raw v would scale steps 3, 4
    decisions = []
    for value in (2.0, 3.0, 3.0, 3.0):
        _set_grad(param, [value])
        decisions.append(ags.step_scale([param]))
    assert [d.smoothed_variability for d in decisions] == [None, 0.5, 0.25, 0.125]
    assert [d.scaled for d in decisions] == [False, False, True, True]


def test_non_finite_gradients_get_no_decision_and_leave_the_state():
    param = nn.Parameter(torch.zeros(1))
    ags = AdaptiveGradientScaler(delta=0.5, s=2.0)
    _set_grad(param, [2.0])
    ags.step_scale([param])
    before = ags.state_dict()
    _set_grad(param, [float("inf")])
    decision = ags.step_scale([param])
    assert decision.skipped and not decision.scaled and param.grad.item() == float("inf")
    assert {**ags.state_dict(), "skipped_steps": 0} == before and ags.skipped_steps == 1


def test_bad_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="s must be"):
        AdaptiveGradientScaler(delta=0.5, s=0.0)
    with pytest.raises(ValueError, match="smoothing"):
        AdaptiveGradientScaler(delta=0.5, s=2.0, smoothing=1.0)
    with pytest.raises(ValueError, match="after backward"):
        AdaptiveGradientScaler(delta=0.5, s=2.0).step_scale([nn.Parameter(torch.zeros(1))])


# -- accumulation, checkpoints, the wrapper ------------------------------------------------------------


def test_four_accumulated_micro_batches_decide_like_the_full_batch():
    full, full_model = _reference_run(micro_batches=1)
    accumulated, accumulated_model = _reference_run(micro_batches=4)
    assert [d.scaled for d, _ in full] == [d.scaled for d, _ in accumulated]
    assert 0 < sum(d.scaled for d, _ in full) < STEPS  # both branches of the rule are exercised
    for (d_full, g_full), (d_acc, g_acc) in zip(full, accumulated):
        assert d_acc.grad_norm == pytest.approx(d_full.grad_norm, rel=1e-5)
        torch.testing.assert_close(g_acc, g_full, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([p.reshape(-1) for p in accumulated_model.parameters()]),
                               torch.cat([p.reshape(-1) for p in full_model.parameters()]), rtol=1e-5, atol=1e-6)  # fmt: skip


def test_a_checkpoint_round_trip_continues_with_identical_decisions():
    batches = _batches(STEPS)
    model = _tiny_model()
    optimizer = AdaptiveGradientScaler.wrap(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), delta=DELTA, s=SCALE, smoothing=0.3)
    for inputs, targets in batches[:3]:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    def continue_from(model, optimizer):
        decisions = []
        for inputs, targets in batches[3:]:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            decisions.append(optimizer.last_decision)
        return decisions

    uninterrupted = continue_from(model, optimizer)
    restored_model = _tiny_model()
    restored = AdaptiveGradientScaler.wrap(torch.optim.SGD(restored_model.parameters(), lr=0.5, momentum=0.9), delta=1.0, s=1.0)
    restored_model.load_state_dict(checkpoint["model"])
    restored.load_state_dict(checkpoint["optimizer"])
    assert (restored.ags.delta, restored.ags.s, restored.ags.smoothing) == (DELTA, SCALE, 0.3)
    resumed = continue_from(restored_model, restored)
    assert resumed == uninterrupted
    assert resumed[0].variability is not None  # the previous norm came back with the checkpoint
    assert restored.ags.state_dict() == optimizer.ags.state_dict()


# -- AMP -------------------------------------------------------------------------------------------------


def test_bf16_autocast_gradients_are_measured_and_scaled_in_fp32():
    model = _tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ags = AdaptiveGradientScaler(optimizer, delta=DELTA, s=SCALE)
    previous_norm, scaled = None, []
    for inputs, targets in _batches():
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), targets)
        assert loss.dtype == torch.float32 and model(inputs).dtype == torch.float32  # autocast ran inside
        loss.backward()
        before = _flat_grads(model)
        decision = ags.step_scale()
        assert before.dtype == torch.float32
        assert decision.grad_norm == pytest.approx(float(before.norm()), rel=1e-6)
        if previous_norm is not None:
            variability = abs(float(before.norm()) - previous_norm) / previous_norm
            assert decision.scaled == (variability < DELTA)
        torch.testing.assert_close(_flat_grads(model), before * decision.factor)
        previous_norm = float(before.norm())
        scaled.append(decision.scaled)
        optimizer.step()
    assert 0 < sum(scaled) < len(scaled)


def _scaler_run(use_wrapper: bool):
    model = _tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    ags = AdaptiveGradientScaler(delta=DELTA, s=SCALE)
    optimizer = AGSOptimizer(sgd, ags) if use_wrapper else sgd
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    decisions = []
    for inputs, targets in _batches():
        optimizer.zero_grad()
        grad_scaler.scale(F.cross_entropy(model(inputs), targets)).backward()
        if not use_wrapper:
            decisions.append(ags.step_scale(optimizer, grad_scaler=grad_scaler))
        grad_scaler.step(optimizer)  # no second unscale; skipped on inf/nan
        grad_scaler.update()
        if use_wrapper:
            decisions.append(optimizer.last_decision)
    return decisions, model


def test_grad_scaler_path_decides_on_unscaled_gradients_like_the_plain_run():
    plain, plain_model = _reference_run()
    for use_wrapper in (False, True):
        decisions, model = _scaler_run(use_wrapper)
        assert [d.scaled for d in decisions] == [d.scaled for d, _ in plain]
        assert [d.grad_norm for d in decisions] == pytest.approx([d.grad_norm for d, _ in plain], rel=1e-6)
        for p, q in zip(model.parameters(), plain_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_grad_scaler_overflow_skips_the_decision_and_the_step():
    model = _tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ags = AdaptiveGradientScaler(optimizer, delta=DELTA, s=SCALE)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    inputs, targets = _batches(1)[0]
    grad_scaler.scale(F.cross_entropy(model(inputs), targets)).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    decision = ags.step_scale(grad_scaler=grad_scaler)
    grad_scaler.step(optimizer)
    grad_scaler.update()
    assert decision.skipped and ags.steps == 0 and ags.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert grad_scaler.get_scale() == 2.0**11


# -- DDP: two gloo processes against one process on the full batch ----------------------------------------


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        results = _ddp_results(rank, world)  # its DDP models gone on return, before the group is
        torch.save(results, f"{out_dir}/rank{rank}.pt")


def _ddp_results(rank: int, world: int) -> dict:
    half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    results = {}
    # DDP, one backward per step; then DDP with 2 accumulated micro-batches (no_sync on the first)
    for name, micro_batches in (("ddp", 1), ("ddp_accumulated", 2)):
        model = nn.parallel.DistributedDataParallel(_tiny_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        ags = AdaptiveGradientScaler(optimizer, delta=DELTA, s=SCALE, process_group=dist.group.WORLD)
        record = []
        for inputs, targets in _batches():
            inputs, targets = inputs[half], targets[half]
            optimizer.zero_grad()
            pieces = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)))
            for index, (piece_in, piece_t) in enumerate(pieces):
                syncing = index == len(pieces) - 1
                with contextlib.nullcontext() if syncing else model.no_sync():
                    (F.cross_entropy(model(piece_in), piece_t) / micro_batches).backward()
            decision = ags.step_scale()
            record.append((decision, _flat_grads(model)))
            optimizer.step()
        results[name] = record
    # no DDP: local gradients, averaged by the scaler's explicit all-reduce
    model = _tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ags = AdaptiveGradientScaler(optimizer, delta=DELTA, s=SCALE, process_group=dist.group.WORLD, all_reduce_gradients=True)
    results["all_reduce"] = _run(model, optimizer, ags, _batches(), part=half)
    return results


def test_two_gloo_processes_decide_and_scale_like_one_process_on_the_full_batch(tmp_path):
    spawn_ranks(_ddp_worker, (2, free_port(), str(tmp_path)), 2, [tmp_path / f"rank{rank}.pt" for rank in (0, 1)])
    full, _ = _reference_run()
    assert 0 < sum(d.scaled for d, _ in full) < STEPS
    margin = min(abs(d.variability - DELTA) for d, _ in full if d.variability is not None)
    assert margin > 1e-3  # float differences between the runs cannot flip a decision
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for name in ("ddp", "ddp_accumulated", "all_reduce"):
        zero, one = ranks[0][name], ranks[1][name]
        assert [d for d, _ in zero] == [d for d, _ in one], name  # identical on every rank, to the bit
        assert [d.scaled for d, _ in zero] == [d.scaled for d, _ in full], name
        for (d_rank, g_rank), (d_full, g_full) in zip(zero, full):
            assert d_rank.grad_norm == pytest.approx(d_full.grad_norm, rel=1e-5), name
            torch.testing.assert_close(g_rank, g_full, rtol=1e-5, atol=1e-7)


# -- the service's JSON --------------------------------------------------------------------------------


def _real_recommendation() -> dict:
    from tula_service.plan.recommend import plan
    from tula_service.spec.job_spec import JobSpec

    batches = [8, 16, 32, 64, 128]
    spec = JobSpec.model_validate(spec_dict(batch_sizes=batches, cluster={"gpus_per_node": 16, "interconnect_gbps": 1000}))
    points = [measurement(b, trace_sigma=1e4) for b in batches]
    for point, series in zip(points, ([0.08, 0.12], [0.2], [0.05, 0.3], [0.15], [0.11])):
        point["gradient"]["variability_series"] = series
    return json.loads(json.dumps(plan(spec, points)))  # as it travels: plain JSON


def test_config_loader_takes_the_service_recommendation_as_is(tmp_path):
    recommendation = _real_recommendation()
    ags_json = recommendation["training_advice"]["ags"]
    expected = (ags_json["delta"]["value"], ags_json["s"]["value"])
    # the measured variabilities' median is 0.12 at their batches; the plan scales them to its (larger) batch
    assert 0 < expected[0] < 0.12 and ags_json["delta"]["source"] == "predicted"
    assert ags_json["s"]["source"] == "fitted" and expected[1] > 1
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps({"job_id": "j1", **recommendation}))  # the API's /recommendation body
    for config in (recommendation, recommendation["training_advice"], ags_json, json.dumps(ags_json), str(path)):
        assert config_values(config) == expected
    scaler = AdaptiveGradientScaler.from_config(recommendation, smoothing=0.2)
    assert (scaler.delta, scaler.s, scaler.smoothing) == (*expected, 0.2)
    assert config_values({"delta": 0.1, "s": 2}) == (0.1, 2.0)


def test_config_loader_names_what_is_missing():
    with pytest.raises(ValueError, match="no number for 's'"):
        config_values({"training_advice": {"ags": {"delta": {"value": 0.1}}}})
    with pytest.raises(ValueError, match="no number for 'delta'"):
        config_values({"delta": {"value": "high"}, "s": 2.0})


def test_delta_infinity_is_static_scaling_after_the_first_step():
    param = nn.Parameter(torch.zeros(1))
    ags = AdaptiveGradientScaler(delta=math.inf, s=2.0)
    decisions = []
    for value in (1.0, 100.0, 0.01):
        _set_grad(param, [value])
        decisions.append(ags.step_scale([param]).scaled)
    assert decisions == [False, True, True]

"""The drop-in gradient-statistics logger in real training loops: accumulation, DDP on gloo, Adam, AMP."""

import contextlib
import json
import math
import os

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from profiler.gradstats import two_batch_estimates  # noqa: E402
from profiler.reference_logger import RECORD_KEYS, GradientStatsLogger  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.gloo_ranks import gloo_group, spawn_ranks  # noqa: E402

torch.set_num_threads(1)

BATCH = 32
STEPS = 6


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=generator), torch.randint(0, 4, (batch,), generator=generator)) for _ in range(steps)]


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def _train(model, optimizer, logger, batches, micro_batches: int, divide: bool = True, part: slice = slice(None), grad_scaler=None):
    """SGD/Adam steps on rows `part` of each batch, each as `micro_batches` accumulated pieces (DDP's
    no_sync on all but the last); returns the records step() gave back."""
    records = []
    for inputs, targets in batches:
        inputs, targets = inputs[part], targets[part]
        optimizer.zero_grad()
        pieces = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)))
        total_loss = 0.0
        for index, (piece_in, piece_t) in enumerate(pieces):
            syncing = index == len(pieces) - 1 or not hasattr(model, "no_sync")
            loss = F.cross_entropy(model(piece_in), piece_t) / (micro_batches if divide else 1)
            total_loss += loss.item() / (1 if divide else micro_batches)
            with contextlib.nullcontext() if syncing else model.no_sync():
                (grad_scaler.scale(loss) if grad_scaler else loss).backward()
        _finish_step(logger, optimizer, records, total_loss, grad_scaler)
    return records


def _finish_step(logger, optimizer, records: list[dict], loss: float, grad_scaler=None) -> None:
    """logger.step (its record, if any, into `records`), then the optimizer's step, through the scaler under AMP."""
    record = logger.step(loss=loss)
    if record is not None:
        records.append(record)
    if grad_scaler:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).double()


def _by_hand(model: nn.Module, optimizer: torch.optim.Optimizer, inputs, targets, micro_batches: int) -> dict:
    """One step's statistics computed directly: each micro-batch's gradient by its own autograd.grad on a
    hook-free copy of the model, g_B their mean; P as Adam's coming step divides by it, g_B folded into its state."""
    reference = _tiny_model()
    reference.load_state_dict(model.state_dict())
    params = list(reference.parameters())
    micro = [_flat(torch.autograd.grad(F.cross_entropy(reference(x), t), params))
             for x, t in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches))]  # fmt: skip
    full = torch.stack(micro).mean(0)
    b, B = len(inputs) // micro_batches, len(inputs)
    result = {"plain": two_batch_estimates([float(g @ g) for g in micro], float(full @ full), b, B), "norm": float(full.norm())}
    states = [optimizer.state.get(p) for p in model.parameters()]
    if isinstance(optimizer, torch.optim.Adam) and all(states):
        beta2, eps = optimizer.param_groups[0]["betas"][1], optimizer.param_groups[0]["eps"]
        second_moment = beta2 * _flat(s["exp_avg_sq"] for s in states) + (1 - beta2) * full**2  # the step's v, at t + 1
        precond = 1 / ((second_moment / (1 - beta2 ** (float(states[0]["step"]) + 1))).sqrt() + eps)
        result["precond"] = two_batch_estimates([float((precond * g) @ (precond * g)) for g in micro], float((precond * full) @ (precond * full)), b, B)
    return result


# -- the record ----------------------------------------------------------------------------------


def test_records_follow_the_contract_and_each_line_is_on_disk_when_its_window_closes(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    path = tmp_path / "stats.jsonl"
    logger = GradientStatsLogger(path, model, optimizer, every=3, accumulation=4)
    records = _train(model, optimizer, logger, _batches(3), micro_batches=4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records  # flushed, logger still open
    _train(model, optimizer, logger, _batches(4), micro_batches=4)
    logger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [list(r) for r in lines] == [list(RECORD_KEYS)] * 3
    assert [(r["samples"], r["batch"], r["step"], r["window_steps"]) for r in lines] == [(96, 32, 3, 3), (192, 32, 6, 3), (224, 32, 7, 1)]
    for r in lines:
        assert all(math.isfinite(r[k]) for k in ("grad_sqr", "trace_sigma", "loss"))
        assert r["trace_sigma"] > 0 and r["metric"] is None and r["precond_grad_sqr"] is None and r["precond_trace_sigma"] is None
    assert lines[0]["variability"] > 0 and lines[2]["variability"] > 0
    from tula_service.fit.gradient_stats_file import read_gradient_stats  # here: the DDP test's processes need not import it

    assert read_gradient_stats(path) == lines  # the service's reader takes the file as written


def test_without_a_path_the_records_are_returned_and_no_file_is_written(tmp_path, monkeypatch):
    """TulaRun takes the records from step() and sends them itself: no JSONL to write, not even to os.devnull."""
    monkeypatch.chdir(tmp_path)
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    logger = GradientStatsLogger(None, model, optimizer, every=3, accumulation=4)
    records = _train(model, optimizer, logger, _batches(6), micro_batches=4)
    logger.close()
    assert [r["step"] for r in records] == [3, 6] and all(r["trace_sigma"] > 0 for r in records)
    assert list(tmp_path.iterdir()) == []


def test_loss_is_the_window_mean_and_metric_the_last_passed(tmp_path):
    model = _tiny_model()
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, every=2, accumulation=2)
    for (inputs, targets), metric in zip(_batches(2), (0.25, 0.75)):
        model.zero_grad()
        for x, t in zip(inputs.chunk(2), targets.chunk(2)):
            (F.cross_entropy(model(x), t) / 2).backward()
        record = logger.step(loss=1.0 if metric < 0.5 else 2.0, metric=metric)
    assert record["loss"] == 1.5 and record["metric"] == 0.75 and record["window_steps"] == 2
    logger.close()


@pytest.mark.parametrize("read_at_once", [frozenset(), frozenset({"cpu"})], ids=["kept-as-on-a-gpu", "read-at-once-on-the-cpu"])
def test_a_loss_tensor_is_read_at_the_window_end_and_gives_the_records_of_floats(tmp_path, monkeypatch, read_at_once):
    """On a GPU, loss.item() before optimizer.step() makes the host wait for the device every step (22% of a
    1.4 ms step on the H200, benchmarks/gpu_check.py): a tensor loss is kept until the window closes. The CPU,
    with nothing to wait for, reads it at once; with READ_AT_ONCE empty, the CPU stands in for the GPU here."""
    monkeypatch.setattr(GradientStatsLogger, "READ_AT_ONCE", read_at_once)
    records = {}
    for kind in ("float", "tensor", "mixed"):
        model = _tiny_model()
        optimizer = _optimizer("adam", model)
        logger = GradientStatsLogger(None, model, optimizer, every=3, accumulation=2)
        records[kind] = []
        for step, (inputs, targets) in enumerate(_batches()):
            optimizer.zero_grad()
            losses = []
            for x, t in zip(inputs.chunk(2), targets.chunk(2)):
                loss = F.cross_entropy(model(x), t) / 2
                loss.backward()
                losses.append(loss.detach())
            total = torch.stack(losses).sum()
            as_tensor = kind == "tensor" or (kind == "mixed" and step % 2 == 0)
            record = logger.step(loss=total.reshape(1) if as_tensor else float(total))
            if record is None and as_tensor and not read_at_once:
                assert logger._losses_device[-1][0] == len(logger._rows_host) - 1  # kept on the device until the window closes
            if read_at_once:
                assert not logger._losses_device
            if record is not None:
                records[kind].append(record)
                assert not logger._losses_device
            optimizer.step()
        logger.close()
    assert len(records["float"]) == STEPS // 3 and all(r["loss"] is not None for r in records["float"])
    assert records["tensor"] == records["float"] and records["mixed"] == records["float"]


def test_a_loss_tensor_of_more_than_one_element_is_refused_by_name(tmp_path):
    model = _tiny_model()
    logger = GradientStatsLogger(None, model, every=2, accumulation=2)
    inputs, targets = _batches(1)[0]
    for x, t in zip(inputs.chunk(2), targets.chunk(2)):
        (F.cross_entropy(model(x), t) / 2).backward()
    with pytest.raises(ValueError, match=r"loss must be a float or a one-element tensor, got a tensor of shape \(2,\)"):
        logger.step(loss=torch.ones(2))
    assert logger.step(loss=torch.tensor(0.5)) is None and logger.steps == 1  # the refused step left nothing behind
    logger.close()


# -- accumulation: the micro-batches are the small batches --------------------------------------------


@pytest.mark.parametrize("divide", [True, False], ids=["loss-divided", "loss-summed"])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_four_micro_batches_give_the_two_batch_estimates_computed_by_hand(tmp_path, optimizer_name, divide):
    model = _tiny_model()
    optimizer = _optimizer(optimizer_name, model)
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=1, accumulation=4, loss_divided_by_accumulation=divide)
    expected, records = [], []
    for inputs, targets in _batches():
        expected.append(_by_hand(model, optimizer, inputs, targets, 4))
        records += _train(model, optimizer, logger, [(inputs, targets)], micro_batches=4, divide=divide)
    logger.close()
    for step, (record, truth) in enumerate(zip(records, expected)):
        assert (record["grad_sqr"], record["trace_sigma"]) == pytest.approx(truth["plain"], rel=1e-5)  # float32 gradients
        if optimizer_name == "adam" and step > 0:
            # P folds g_B into Adam's float32 state: float32 rounding, which the estimate's difference amplifies a little
            assert (record["precond_grad_sqr"], record["precond_trace_sigma"]) == pytest.approx(truth["precond"], rel=1e-4)
        else:
            assert record["precond_grad_sqr"] is None and record["precond_trace_sigma"] is None
    norms = [truth["norm"] for truth in expected]
    assert [r["variability"] for r in records[1:]] == pytest.approx([abs(b - a) / a for a, b in zip(norms, norms[1:])], rel=1e-4)


def test_a_window_averages_numerator_and_denominator_over_its_steps(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=STEPS, accumulation=4)
    expected = []
    for inputs, targets in _batches():
        expected.append(_by_hand(model, optimizer, inputs, targets, 4)["plain"])
        _train(model, optimizer, logger, [(inputs, targets)], micro_batches=4)
    logger.close()
    assert (logger.last_record["grad_sqr"], logger.last_record["trace_sigma"]) == pytest.approx(
        (sum(g for g, _ in expected) / STEPS, sum(t for _, t in expected) / STEPS), rel=1e-6
    )


def test_sampling_takes_statistics_on_two_consecutive_steps_in_every_n_and_counts_every_sample(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=STEPS, accumulation=4, sample_every=4)
    expected = []
    for step, (inputs, targets) in enumerate(_batches()):
        by_hand = _by_hand(model, optimizer, inputs, targets, 4)["plain"]
        if step % 4 in (0, 1):
            expected.append(by_hand)
        _train(model, optimizer, logger, [(inputs, targets)], micro_batches=4)
    logger.close()
    record = logger.last_record
    assert record["window_steps"] == len(expected) == 4  # steps 0, 1, 4 and 5 of 6
    assert record["samples"] == STEPS * BATCH and record["step"] == STEPS
    assert (record["grad_sqr"], record["trace_sigma"]) == pytest.approx(
        (sum(g for g, _ in expected) / 4, sum(t for _, t in expected) / 4), rel=1e-6
    )
    assert record["variability"] is not None  # from the pairs (0, 1) and (4, 5), never across the gap


def test_a_step_without_statistics_may_run_as_one_pass():
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    with GradientStatsLogger(os.devnull, model, optimizer, every=STEPS, accumulation=4, sample_every=3) as logger:
        for inputs, targets in _batches():
            micro_batches = 4 if logger.sampling else 1
            _train(model, optimizer, logger, [(inputs, targets)], micro_batches=micro_batches)
    assert logger.last_record["samples"] == STEPS * BATCH and logger.last_record["window_steps"] == 4  # steps 0, 1, 3, 4


def test_a_new_sampling_period_waits_for_the_pair_under_way_and_hooks_follow_it():
    """sample_every 2 in 4 -> 8 asked on the second step of a pair: the pair finishes, then the next pair starts at
    the next multiple of 8; the per-parameter hooks are there exactly on the sampled steps."""
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    sampled, hooked = [], []
    with GradientStatsLogger(os.devnull, model, optimizer, every=100, accumulation=4, sample_every=4) as logger:
        for step, batch in enumerate(_batches(steps=20)):
            if step == 5:  # steps 4 and 5 are a pair: the change waits for step 5 to end
                logger.set_sample_every(8)
                assert logger.sample_every == 4
            sampled.append(logger.sampling)
            hooked.append(bool(logger._grad_hooks))
            _train(model, optimizer, logger, [batch], micro_batches=4 if logger.sampling else 1)
    assert [s for s, on in enumerate(sampled) if on] == [0, 1, 4, 5, 8, 9, 16, 17]
    assert hooked == sampled
    assert logger.last_record["window_steps"] == 8 and logger.last_record["samples"] == 20 * BATCH
    with pytest.raises(ValueError, match="sample_every"):
        logger.set_sample_every(0)


def test_the_statistics_hooks_come_off_autograd_between_pairs_and_leave_the_users_own_hooks_alone():
    """A removed tensor hook leaves its emptied dict registered with autograd, called on every backward pass; the
    logger takes it out where nothing else is left in it (reference_logger._unregister_empty_hook_dicts), and a hook
    the loop put on a parameter itself keeps running, before, during and after the sampled pairs."""
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    weight = model[0].weight
    calls = []
    weight.register_hook(lambda grad: calls.append(1))
    others = [p for p in model.parameters() if p is not weight]
    with GradientStatsLogger(os.devnull, model, optimizer, every=100, accumulation=4, sample_every=4) as logger:
        for step, batch in enumerate(_batches(steps=10)):
            micro_batches = 4 if logger.sampling else 1
            _train(model, optimizer, logger, [batch], micro_batches=micro_batches)
            assert len(calls) == micro_batches  # the loop's hook ran on every backward pass
            calls.clear()
            if not logger.sampling:  # the coming step is plain: no hook dict left on the others, the loop's own kept
                assert all(p._backward_hooks is None for p in others)
                assert len(weight._backward_hooks) == 1
    assert logger.last_record["window_steps"] == 6  # pairs (0, 1), (4, 5), (8, 9): registered again each time
    assert all(p._backward_hooks is None for p in others) and len(weight._backward_hooks) == 1


def test_a_window_without_a_sampled_step_writes_its_counts_only_when_asked(tmp_path):
    for counts_only in (False, True):
        model = _tiny_model()
        optimizer = _optimizer("sgd", model)
        path = tmp_path / f"{counts_only}.jsonl"
        with GradientStatsLogger(path, model, optimizer, every=3, accumulation=4, sample_every=6, counts_only_records=counts_only) as logger:
            for batch in _batches(steps=6):
                _train(model, optimizer, logger, [batch], micro_batches=4 if logger.sampling else 1, part=slice(0, 16 if logger.sampling else 32))
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert records[0]["step"] == 3 and records[0]["grad_sqr"] is not None  # steps 0 and 1 sampled
        # the record closes the window at step 3 (16 + 16 + 32 samples: the sampled steps trained on 16), its statistics
        # were taken on steps 0 and 1, after 16 and 32 samples
        assert (records[0]["samples"], records[0]["statistics_samples"]) == (64, 24)
        if not counts_only:
            assert len(records) == 1  # the window of steps 3-5 had no statistics
            continue
        second = records[1]
        assert set(second) == set(RECORD_KEYS)
        assert (second["step"], second["window_steps"], second["batch"], second["samples"]) == (6, 0, 32, 2 * 16 + 4 * 32)
        assert second["grad_sqr"] is None and second["trace_sigma"] is None and second["loss"] > 0


def test_a_counts_only_window_of_unequal_plain_steps_counts_every_pass_and_takes_the_common_batch():
    """The counts-only record (no step of the window sampled) has its own short path: its samples count every forward
    pass of every step (one pass or several, of any size), its batch is the window's most common, its loss the mean of
    the losses given (floats and tensors alike)."""
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    logger = GradientStatsLogger(None, model, optimizer, every=4, accumulation=2, sample_every=8, counts_only_records=True)
    batches = iter(_batches(steps=8))
    for _ in range(4):  # the first window: steps 0 and 1 sampled
        _train(model, optimizer, logger, [next(batches)], micro_batches=2 if logger.sampling else 1)
    sizes, losses = [(32,), (16, 16), (20,), (32,)], [0.5, 1.0, 2.0, 4.5]
    for step_sizes, loss in zip(sizes, losses):
        assert not logger.sampling
        inputs, targets = next(batches)
        optimizer.zero_grad()
        start = 0
        for size in step_sizes:
            F.cross_entropy(model(inputs[start : start + size]), targets[start : start + size]).backward()
            start += size
        record = logger.step(loss=torch.tensor([loss]) if loss > 1 else loss)
        optimizer.step()
    assert record["window_steps"] == 0 and record["grad_sqr"] is None and record["variability"] is None
    assert (record["step"], record["batch"], record["samples"]) == (8, 32, 4 * 32 + 32 + 32 + 20 + 32)
    assert record["loss"] == pytest.approx(sum(losses) / 4, rel=1e-12)
    logger.close()


def test_rmsprop_precond_pair_is_the_two_batch_estimate_of_its_preconditioned_gradient(tmp_path):
    """One window of 3 steps of 2 accumulated halves: precond_grad_sqr and precond_trace_sigma are the two-batch
    estimates of P g, P = 1 / (sqrt(square_avg') + eps) with square_avg' = alpha square_avg + (1 - alpha) g_B^2, what
    RMSprop's step divides by (none on the first: no state before it)."""
    model = _tiny_model()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    logger = GradientStatsLogger(None, model, optimizer, every=3, accumulation=2)
    expected = []
    for step, (inputs, targets) in enumerate(_batches(steps=3)):
        optimizer.zero_grad()
        halves, accumulated = [], 0
        for piece_in, piece_t in zip(inputs.chunk(2), targets.chunk(2)):
            loss = F.cross_entropy(model(piece_in), piece_t) / 2
            loss.backward()
            summed = _flat([p.grad for p in model.parameters()])
            halves.append(2 * (summed - accumulated))  # this half's own gradient
            accumulated = summed
        if step > 0:
            folded = 0.99 * _flat([optimizer.state[p]["square_avg"] for p in model.parameters()]) + 0.01 * (sum(halves) / 2) ** 2
            scale = 1 / (folded.sqrt() + 1e-8)
            micro = [float(((h * scale) ** 2).sum()) for h in halves]
            expected.append(two_batch_estimates(micro, float(((sum(halves) / 2 * scale) ** 2).sum()), BATCH // 2, BATCH))
        record = logger.step(loss=float(loss.detach()))
        optimizer.step()
    logger.close()
    assert record["precond_grad_sqr"] == pytest.approx(sum(g for g, _ in expected) / 2, rel=1e-5)
    assert record["precond_trace_sigma"] == pytest.approx(sum(t for _, t in expected) / 2, rel=1e-5)


def test_adam_precond_pair_is_null_only_before_the_optimizer_has_state(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("adam", model)
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=3, accumulation=2)
    records = _train(model, optimizer, logger, _batches(), micro_batches=2)
    logger.close()
    assert len(records) == 2
    for record in records:  # the first window's first step has no state; its other two steps do
        assert math.isfinite(record["precond_grad_sqr"]) and record["precond_trace_sigma"] > 0
    # 1/(sqrt(v_hat)+eps) normalizes each coordinate: the preconditioned gradient is far larger than the raw one
    assert records[1]["precond_trace_sigma"] > 10 * records[1]["trace_sigma"]


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.Adamax, torch.optim.RMSprop])
def test_the_precond_pair_weighs_by_the_p_the_step_divides_by_even_where_the_state_had_no_gradient_yet(optimizer_class):
    """Oracle: P read from the state right after optimizer.step() (what that step divided by). The logger, called before
    the step, must give the two-batch estimates with that P. The first layer's weights on input 7 get no gradient while
    that input is 0 (the first 3 steps), so their second moment stays 0; P read before the step would count them at
    1 / eps = 1e8 when the input turns on."""
    from profiler.preconditioner import preconditioner

    model = _tiny_model()
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    batches = _batches(steps=6)
    for inputs, _ in batches[:3]:
        inputs[:, 7] = 0.0
    expected, records = [], []
    with GradientStatsLogger(None, model, optimizer, every=1, accumulation=2) as logger:
        for inputs, targets in batches:
            optimizer.zero_grad()
            micro = []
            for piece_in, piece_t in zip(inputs.chunk(2), targets.chunk(2)):
                before = _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
                (F.cross_entropy(model(piece_in), piece_t) / 2).backward()
                micro.append(2 * (_flat([p.grad for p in params]) - before))
            full = sum(micro) / 2
            _finish_step(logger, optimizer, records, 0.0)
            scale = preconditioner(optimizer, params).double()
            expected.append(two_batch_estimates([float(((g * scale) ** 2).sum()) for g in micro], float(((full * scale) ** 2).sum()), BATCH // 2, BATCH))
    for step, (record, truth) in enumerate(zip(records, expected)):
        if step == 0:  # no second moment before the first step
            assert record["precond_grad_sqr"] is None
            continue
        assert (record["precond_grad_sqr"], record["precond_trace_sigma"]) == pytest.approx(truth, rel=1e-4)
    assert records[3]["precond_trace_sigma"] < 1e6  # the step input 7 turns on: bounded, not (g / eps)^2


def test_a_model_whose_precond_sums_would_pass_the_memory_bound_gets_no_precond_pair_and_a_warning():
    """The sums take the adaptive parameters' float32 size (the tiny model: 212 values, 848 bytes); past
    precond_max_bytes the records carry a null pair and the raw one, and the logger says so at once."""
    model = _tiny_model()
    optimizer = _optimizer("adam", model)
    with pytest.warns(UserWarning, match="precond_max_bytes"):
        logger = GradientStatsLogger(None, model, optimizer, every=3, accumulation=2, precond_max_bytes=847)
    records = _train(model, optimizer, logger, _batches(), micro_batches=2)
    logger.close()
    assert all(r["precond_grad_sqr"] is None and r["precond_trace_sigma"] is None and r["trace_sigma"] > 0 for r in records)
    model = _tiny_model()
    optimizer = _optimizer("adam", model)
    with GradientStatsLogger(None, model, optimizer, every=3, accumulation=2, precond_max_bytes=848) as logger:
        kept = _train(model, optimizer, logger, _batches(), micro_batches=2)
    assert all(r["precond_grad_sqr"] is not None for r in kept)


# -- a problem whose answer is known ---------------------------------------------------------------


def test_linear_regression_with_known_noise_gives_the_analytic_trace_and_gradient_norm(tmp_path):
    """Loss 0.5 (x.w - y)^2, x ~ N(0, I_d), y = x.w* + eps, eps ~ N(0, s^2): per-sample gradient
    x (x.delta - eps) with delta = w - w*, so |G|^2 = |delta|^2 and tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2."""
    dim, noise_std, batch, micro_batches, steps = 10, 1.0, 256, 4, 300
    generator = torch.Generator().manual_seed(0)
    w_star = torch.randn(dim, generator=generator)
    delta = 0.4 * torch.randn(dim, generator=generator)
    model = nn.Linear(dim, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w_star + delta)
    true_sq = float(delta @ delta)
    trace = dim * (true_sq + noise_std**2) + true_sq
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, every=steps, accumulation=micro_batches)
    for _ in range(steps):  # the weights stay put: every step samples the same G and Sigma
        x = torch.randn(batch, dim, generator=generator)
        y = x @ w_star + noise_std * torch.randn(batch, generator=generator)
        model.zero_grad()
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (0.5 * (model(xs).squeeze(1) - ys).pow(2).mean() / micro_batches).backward()
        record = logger.step()
    logger.close()
    assert record["trace_sigma"] == pytest.approx(trace, rel=0.05)
    assert record["grad_sqr"] == pytest.approx(true_sq, rel=0.15)
    assert record["trace_sigma"] / record["grad_sqr"] == pytest.approx(trace / true_sq, rel=0.15)


# -- AMP and batches that differ ---------------------------------------------------------------------


def test_grad_scaler_gives_the_statistics_of_the_unscaled_run(tmp_path):
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        model = _tiny_model()
        optimizer = _optimizer("adam", model)
        logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=2, accumulation=2, grad_scaler=scaler)
        runs.append(_train(model, optimizer, logger, _batches(), micro_batches=2, grad_scaler=scaler))
        logger.close()
    plain, scaled = runs
    for a, b in zip(plain, scaled):
        assert a.keys() == b.keys()
        for key in RECORD_KEYS:
            assert a[key] == (None if b[key] is None else pytest.approx(b[key], rel=1e-5)), key


def test_an_overflowed_step_counts_its_samples_but_gives_no_statistics(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=3, accumulation=2, grad_scaler=scaler)
    for index, (inputs, targets) in enumerate(_batches(3)):
        optimizer.zero_grad()
        for x, t in zip(inputs.chunk(2), targets.chunk(2)):
            scaler.scale(F.cross_entropy(model(x), t) / 2).backward()
        if index == 1:
            model[0].weight.grad[0, 0] = float("inf")
        record = logger.step()
        scaler.step(optimizer)
        scaler.update()
    logger.close()
    assert (record["samples"], record["window_steps"], record["step"]) == (3 * BATCH, 2, 3)
    assert math.isfinite(record["grad_sqr"]) and math.isfinite(record["variability"])


def test_a_smaller_last_batch_counts_its_samples_but_not_in_the_statistics(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, optimizer, every=10, accumulation=4)  # batch read from the inputs
    batches = _batches(2) + _batches(1, batch=20) + _batches(1, batch=30)  # 20: 4 x 5 (another batch); 30: 8, 8, 8, 6
    _train(model, optimizer, logger, batches, micro_batches=4)
    logger.close()
    record = logger.last_record
    assert (record["samples"], record["batch"], record["window_steps"], record["step"]) == (2 * BATCH + 50, BATCH, 2, 4)


# -- mistakes a user can make ------------------------------------------------------------------------


def test_one_process_with_one_gradient_a_step_is_refused_at_its_first_step_with_what_to_do(tmp_path):
    model = _tiny_model()
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, every=2)  # backward(losses) may come: not refused yet
    inputs, targets = _batches(1)[0]
    F.cross_entropy(model(inputs), targets).backward()
    with pytest.raises(ValueError, match=r"nothing to compare.*logger.backward\(losses\).*accumulation=k"):
        logger.step()
    logger.close()
    with pytest.raises(ValueError, match="device_batch must be a whole number >= 1"):
        GradientStatsLogger(tmp_path / "t.jsonl", _tiny_model(), accumulation=2, device_batch=0)
    assert not (tmp_path / "t.jsonl").exists()


# -- one process without accumulation: backward(losses) -----------------------------------------------


def _train_with_backward(model, optimizer, logger, batches, grad_scaler=None) -> tuple[list[dict], list[int]]:
    """The plain loop of the module docstring: one forward pass of the whole batch, logger.backward(per-sample losses);
    returns the records and the backward passes each step ran (counted by a hook on the logits)."""
    records, passes = [], []
    for inputs, targets in batches:
        optimizer.zero_grad()
        counted = [0]
        logits = model(inputs)
        logits.register_hook(lambda grad: counted.__setitem__(0, counted[0] + 1))
        losses = F.cross_entropy(logits, targets, reduction="none")
        loss = logger.backward(losses)
        assert loss.item() == pytest.approx(losses.mean().item())
        passes.append(counted[0])
        _finish_step(logger, optimizer, records, loss.item(), grad_scaler)
    return records, passes


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("sample_every", [1, 4])
def test_backward_of_the_per_sample_losses_gives_the_records_of_two_accumulated_halves(tmp_path, optimizer_name, sample_every):
    """The same run twice: accumulation=2 on each batch's two halves, and one pass of the whole batch with
    logger.backward(losses). The gradients are the same, so the weights, the records and the Adam pair are too; the
    second backward pass runs on the sampled steps only."""
    runs = []
    for mode in ("accumulated", "backward"):
        model = _tiny_model()
        optimizer = _optimizer(optimizer_name, model)
        accumulation = 2 if mode == "accumulated" else 1
        logger = GradientStatsLogger(None, model, optimizer, every=4, accumulation=accumulation, sample_every=sample_every)
        if mode == "accumulated":
            runs.append((_train(model, optimizer, logger, _batches(8), micro_batches=2), None, model))
        else:
            runs.append((*_train_with_backward(model, optimizer, logger, _batches(8)), model))
        logger.close()
    (accumulated, _, model_a), (split, passes, model_b) = runs
    assert len(accumulated) == len(split) == 2
    for a, b in zip(accumulated, split):
        assert a.keys() == b.keys()
        for key in RECORD_KEYS:  # float32 sums in another order (one pass, two halves): grad_sqr, a difference, 1.2e-6 apart on one CPU
            assert b[key] == (None if a[key] is None else pytest.approx(a[key], rel=1e-5)), key
        assert b["window_steps"] == (4 if sample_every == 1 else 2) and math.isfinite(b["grad_sqr"]) and b["trace_sigma"] > 0
        assert (b["precond_grad_sqr"] is None) == (optimizer_name == "sgd")
    sampled = [step % sample_every in (0, 1) if sample_every > 1 else True for step in range(8)]
    assert passes == [2 if on else 1 for on in sampled]
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_backward_under_a_grad_scaler_gives_the_statistics_of_the_unscaled_run():
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        model = _tiny_model()
        optimizer = _optimizer("adam", model)
        logger = GradientStatsLogger(None, model, optimizer, every=2, grad_scaler=scaler)
        runs.append(_train_with_backward(model, optimizer, logger, _batches(), grad_scaler=scaler)[0])
        logger.close()
    for a, b in zip(*runs):
        for key in RECORD_KEYS:
            assert a[key] == (None if b[key] is None else pytest.approx(b[key], rel=1e-5)), key


def test_backward_of_an_odd_batch_counts_its_samples_and_of_a_token_model_takes_each_samples_mean():
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    logger = GradientStatsLogger(None, model, optimizer, every=3)
    batches = _batches(2) + _batches(1, batch=BATCH - 1)  # the odd one: unequal halves, left out of the statistics
    records, passes = _train_with_backward(model, optimizer, logger, batches)
    assert passes == [2, 2, 2]
    assert (records[0]["samples"], records[0]["batch"], records[0]["window_steps"]) == (3 * BATCH - 1, BATCH, 2)
    tokens = torch.arange(12, dtype=torch.float64).reshape(4, 3).requires_grad_()
    logger = GradientStatsLogger(None, nn.Linear(1, 1), sample_every=4)
    logger.steps = 2  # a step without statistics: one backward pass of the mean
    assert logger.backward(tokens).item() == pytest.approx(5.5)
    torch.testing.assert_close(tokens.grad, torch.full((4, 3), 1 / 12, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"per-sample losses \(reduction='none'\)"):
        logger.backward(tokens.sum())


def test_a_wrong_accumulation_count_is_named_at_the_first_step(tmp_path):
    model = _tiny_model()
    logger = GradientStatsLogger(tmp_path / "s.jsonl", model, every=2, accumulation=4)
    inputs, targets = _batches(1)[0]
    for x, t in zip(inputs.chunk(2), targets.chunk(2)):
        (F.cross_entropy(model(x), t) / 2).backward()
    with pytest.raises(ValueError, match="2 backward passes since the last step, but accumulation=4"):
        logger.step()
    with pytest.raises(RuntimeError, match="no backward pass"):
        logger.step()
    logger.close()


def test_an_error_inside_the_context_keeps_the_written_records_and_removes_the_hooks(tmp_path):
    model = _tiny_model()
    optimizer = _optimizer("sgd", model)
    path = tmp_path / "s.jsonl"
    with pytest.raises(KeyboardInterrupt), GradientStatsLogger(path, model, optimizer, every=2, accumulation=2) as logger:
        _train(model, optimizer, logger, _batches(3), micro_batches=2)
        raise KeyboardInterrupt
    assert len(path.read_text().splitlines()) == 1  # the partial window is dropped
    F.cross_entropy(model(_batches(1)[0][0]), _batches(1)[0][1]).backward()  # no hook left to record it
    assert logger._tally.micro_norms == []


# -- DDP: two gloo processes against one process on the same data ------------------------------------------


DDP_CASES = (("adam", 1), ("sgd", 2))  # (optimizer, micro-batches per rank): one backward, then no_sync accumulation


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        results = _ddp_results(rank, world, out_dir)  # its DDP models gone on return, before the group is
        torch.save(results, f"{out_dir}/rank{rank}.pt")


def _ddp_results(rank: int, world: int, out_dir: str) -> dict:
    half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    results = {}
    try:
        GradientStatsLogger(f"{out_dir}/refused.jsonl", _tiny_model(), accumulation=2)
    except ValueError as error:  # 2 processes, a model DDP does not wrap: its .grad would be local
        results["refused"] = str(error)
    for optimizer_name, micro_batches in DDP_CASES:
        model = nn.parallel.DistributedDataParallel(_tiny_model())
        optimizer = _optimizer(optimizer_name, model)
        path = f"{out_dir}/{optimizer_name}.jsonl"
        with GradientStatsLogger(path, model, optimizer, every=2, accumulation=micro_batches) as logger:
            results[optimizer_name] = _train(model, optimizer, logger, _batches(), micro_batches, part=half)
    return results


def test_two_gloo_processes_give_the_statistics_of_one_process_on_the_same_micro_batches(tmp_path):
    spawn_ranks(_ddp_worker, (2, free_port(), str(tmp_path)), 2, [tmp_path / f"rank{rank}.pt" for rank in (0, 1)])
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert all("not a DistributedDataParallel" in results.get("refused", "") for results in ranks)
    for optimizer_name, micro_batches in DDP_CASES:
        # one process, accumulating the same pieces in rank order: rank 0's half, then rank 1's
        model = _tiny_model()
        optimizer = _optimizer(optimizer_name, model)
        with GradientStatsLogger(tmp_path / "single.jsonl", model, optimizer, every=2, accumulation=2 * micro_batches) as logger:
            single = _train(model, optimizer, logger, _batches(), 2 * micro_batches)
        written = [json.loads(line) for line in (tmp_path / f"{optimizer_name}.jsonl").read_text().splitlines()]
        assert written == ranks[0][optimizer_name] == ranks[1][optimizer_name]  # every rank agrees; rank 0 wrote it
        assert len(written) == len(single) == STEPS // 2
        for ddp_record, single_record in zip(written, single):
            assert ddp_record["batch"] == BATCH and ddp_record["samples"] == single_record["samples"]
            for key in ("grad_sqr", "trace_sigma", "loss", "variability", "precond_grad_sqr", "precond_trace_sigma"):
                if single_record[key] is None:
                    assert ddp_record[key] is None, key
                else:
                    assert ddp_record[key] == pytest.approx(single_record[key], rel=1e-4), (optimizer_name, key)
        assert (written[-1]["precond_grad_sqr"] is not None) == (optimizer_name == "adam")


def test_a_stability_measurement_leaves_the_training_as_it_was_with_dropout_and_batch_norm(tmp_path):
    """Its forward pass draws dropout masks and moves batch norm's running statistics: both are restored, so the run
    with measurements trains exactly as the run without them."""
    fixed_inputs, fixed_targets = _batches(1, 64)[0]

    def run(measure: bool) -> tuple[list[torch.Tensor], list[dict]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
        optimizer = _optimizer("sgd", model)
        logger = GradientStatsLogger(tmp_path / f"kept-{measure}.jsonl", model, optimizer, every=3, accumulation=4)
        records = []
        for index, batch in enumerate(_batches(6)):
            records += _train(model, optimizer, logger, [batch], micro_batches=4)
            if measure and index in (1, 3):
                assert logger.measure_stability(lambda: F.cross_entropy(model(fixed_inputs), fixed_targets)) is not None
        logger.close()
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())], records

    plain_state, plain_records = run(False)
    state, records = run(True)
    assert all(torch.equal(a, b) for a, b in zip(state, plain_state))
    assert [r["grad_sqr"] for r in records] == [r["grad_sqr"] for r in plain_records]


def test_a_stability_measurement_goes_into_the_next_record_and_leaves_the_statistics_alone(tmp_path):
    """measure_stability() between steps: its own forward and backward passes are not counted as micro-batches,
    and the next record carries the most restrictive measurement since the last one (the smallest headroom x LR),
    with the LR it was measured at."""
    fixed_inputs, fixed_targets = _batches(1, 64)[0]

    def run(measure: bool):
        model = _tiny_model()
        optimizer = _optimizer("sgd", model)
        logger = GradientStatsLogger(tmp_path / f"stats-{measure}.jsonl", model, optimizer, every=3, accumulation=4)
        loss_fn = lambda: F.cross_entropy(model(fixed_inputs), fixed_targets)  # noqa: E731
        records, measured = [], []
        for index, batch in enumerate(_batches(6)):
            records += _train(model, optimizer, logger, [batch], micro_batches=4)
            if measure and index in (0, 1):
                optimizer.param_groups[0]["lr"] = 0.3 if index == 0 else 0.15  # a decayed LR: the headroom doubles
                measured.append(logger.measure_stability(loss_fn))
                optimizer.param_groups[0]["lr"] = 0.3
        logger.close()
        return records, measured

    plain, _ = run(False)
    records, measured = run(True)
    assert all(m is not None and m["stability_headroom"] > 0 for m in measured) and [m["lr"] for m in measured] == [0.3, 0.15]
    tightest = min(measured, key=lambda m: m["stability_headroom"] * m["lr"])
    assert (records[0]["stability_headroom"], records[0]["stability_lr"]) == (tightest["stability_headroom"], tightest["lr"])
    assert "stability_headroom" not in records[1] and all("stability_headroom" not in r for r in plain)
    for ours, theirs in zip(records, plain):
        assert ours["samples"] == theirs["samples"] and ours["grad_sqr"] == pytest.approx(theirs["grad_sqr"], rel=1e-9)
    from tula_service.spec.job_spec import GradientStatsRecord

    assert GradientStatsRecord.model_validate(records[0]).stability_lr == records[0]["stability_lr"]
    with pytest.raises(ValueError, match="optimizer"):
        GradientStatsLogger(None, _tiny_model(), None, every=3, accumulation=4).measure_stability(lambda: None)

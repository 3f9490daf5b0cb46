"""The Lightning and Hugging Face callbacks (profiler.integrations) in real tiny training runs on CPU: telemetry
reaches a real server at the trainer's step numbers, advice comes back, the run closes; a dead server costs
the training nothing and the offline JSONL holds the records; an epoch's partial accumulation step is left
out; and the statistics are at the true gradient's scale, checked against the gradient of the step's mean
loss recomputed here (|G|^2 + tr(Sigma)/B is the mean of |g_B|^2 over a window's steps, exactly)."""

import json
import math
import socket
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from profiler.integrations.huggingface import TulaTrainerCallback  # noqa: E402
from profiler.integrations.lightning import TulaLightningCallback  # noqa: E402
from profiler.tula_run import BUDGET_MIN_SAMPLE_EVERY, TulaRun  # noqa: E402
from tests.api_fixtures import run_on_a_server  # noqa: E402
from tests.integration_models import MICRO_BATCH, LightningClassifier, MeanLoss, Samples, TrueGradient, data  # noqa: E402

ACCUMULATION, EVERY, STEPS = 2, 10, 40
ADVICE_WAIT_S = 30.0


@pytest.fixture
def run_on_server(make_server, tmp_path):
    return run_on_a_server(make_server, tmp_path)


@pytest.fixture
def dead_server_url():
    """A URL on a port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _assert_true_scale(records: list[dict], true_grad_sqr: dict[int, float], dropped: frozenset[int] = frozenset()) -> None:
    """Each window's |G|^2 + tr(Sigma)/B against the mean |g_B|^2 of its steps (the two-batch estimates'
    identity); a wrong loss_divided_by_accumulation is off by ACCUMULATION^2. `dropped`: steps left out."""
    batch = MICRO_BATCH * ACCUMULATION
    for record in records:
        steps = [step for step in range(record["step"], 0, -1) if step not in dropped][:EVERY]
        window = [true_grad_sqr[step] for step in steps]
        measured = record["grad_sqr"] + record["trace_sigma"] / batch
        assert measured == pytest.approx(sum(window) / len(window), rel=1e-4), record


def _assert_statistics(records: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in records] == steps
    for record in records:
        assert math.isfinite(record["grad_sqr"]) and math.isfinite(record["trace_sigma"]) and record["trace_sigma"] > 0, record
        assert record["device_batch"] == MICRO_BATCH and record["accumulation"] == ACCUMULATION, record


def _server_records(server, run_id) -> list[dict]:
    return httpx.get(f"{server.url}/v1/runs/{run_id}/telemetry", timeout=10).json()["records"]


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _await_advice(tula) -> None:
    """What a user's code does to read the advice during training: wait for the first one (bounded)."""
    deadline = time.monotonic() + ADVICE_WAIT_S
    while tula.advice is None and time.monotonic() < deadline:
        time.sleep(0.05)


# -- PyTorch Lightning ----------------------------------------------------------------------------------


class _AwaitAdviceAtTrainEnd(lightning.Callback):
    def __init__(self, tula):
        self.tula = tula

    def on_train_end(self, trainer, pl_module):  # before the Tula callback closes the run at on_fit_end
        _await_advice(self.tula)


def _fit_lightning(tula: TulaLightningCallback, micro_batches: int, *callbacks, epochs: int = 1) -> tuple[lightning.Trainer, LightningClassifier]:
    module = LightningClassifier()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data(micro_batches)), batch_size=MICRO_BATCH)
    trainer = lightning.Trainer(max_epochs=epochs, accumulate_grad_batches=ACCUMULATION, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, tula])  # fmt: skip
    trainer.fit(module, loader)
    return trainer, module


def test_lightning_run_sends_telemetry_gets_advice_and_closes(run_on_server, monkeypatch):
    server, run_id = run_on_server
    closes, close = [], TulaRun.close
    monkeypatch.setattr(TulaRun, "close", lambda run, **options: closes.append(options) or close(run, **options))
    tula = TulaLightningCallback(server.url, run_id, every=EVERY, plan_every_s=0.2)
    trainer, module = _fit_lightning(tula, STEPS * ACCUMULATION, _AwaitAdviceAtTrainEnd(tula))
    assert trainer.global_step == STEPS and tula.run.accumulation == ACCUMULATION  # from trainer.accumulate_grad_batches
    records = _server_records(server, run_id)
    _assert_statistics(records, [10, 20, 30, 40])
    _assert_true_scale(records, module.true_grad_sqr)
    assert all(r["loss"] > 0 and r["step_time_s"] > 0 for r in records)
    assert closes == [{"flush_timeout_s": 10.0}]  # on_fit_end and teardown both came: closed once
    assert tula.closed and tula.run.sent == 4 and tula.run.buffered == 0 and tula.dropped_steps == 0
    assert tula.advice is not None and tula.advice["run_id"] == run_id and "config" in tula.advice
    view = httpx.get(f"{server.url}/v1/runs/{run_id}", timeout=10).json()
    assert view["records"] == 4 and view["last_step"] == STEPS


def test_lightning_with_a_dead_server_trains_on_and_keeps_the_records_offline(dead_server_url, tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tula = TulaLightningCallback(dead_server_url, "run-1", every=EVERY, offline_path=path, timeout_s=0.2, flush_timeout_s=0.2, plan_every_s=3600)
    trainer, module = _fit_lightning(tula, 41, epochs=2)  # each epoch ends with a one-micro-batch step: 21 and 42, left out
    assert trainer.global_step == 42 and tula.dropped_steps == 2
    records = _jsonl(path)
    _assert_statistics(records, [10, 20, 31, 41])  # the trainer's step numbers, across the gap
    _assert_true_scale(records, module.true_grad_sqr, dropped=frozenset({21, 42}))
    assert tula.closed and tula.run.sent == 0 and tula.run.failed_posts >= 1 and tula.advice is None


def _assert_sampling_options_reach_the_run(tula, records: list[dict]) -> None:
    """sample_every and overhead_budget passed to a callback set its TulaRun's sampling: the budget's floor of
    sampling (at least BUDGET_MIN_SAMPLE_EVERY), its estimate, and a record per window whether sampled or not."""
    assert tula.run.overhead_budget == 0.5 and tula.run.min_sample_every == max(4, BUDGET_MIN_SAMPLE_EVERY)
    assert tula.run.logger.sample_every >= tula.run.min_sample_every
    assert tula.run.overhead is not None and tula.run.overhead["budget"] == 0.5
    assert [r["step"] for r in records] == [10, 20, 30, 40] and all(r["step_time_s"] > 0 for r in records)


def test_lightning_on_one_device_without_accumulation_is_refused_before_training_with_its_own_fix(tmp_path):
    tula = TulaLightningCallback(None, "run-1", offline_path=tmp_path / "t.jsonl")
    module = LightningClassifier()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data(8)), batch_size=MICRO_BATCH)
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[tula])  # fmt: skip
    with pytest.raises(ValueError, match=r"nothing to compare. Train with Trainer\(accumulate_grad_batches=2\)"):
        trainer.fit(module, loader)
    assert tula.run is None and not (tmp_path / "t.jsonl").exists()


def test_lightning_callback_passes_sampling_and_the_overhead_budget_to_its_run(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tula = TulaLightningCallback(None, "run-1", every=EVERY, offline_path=path, sample_every=4, overhead_budget=0.5, post_every_s=0.5)
    _fit_lightning(tula, STEPS * ACCUMULATION)
    _assert_sampling_options_reach_the_run(tula, _jsonl(path))


# A gloo rank can abort after training, as its C++ threads are torn down (seen in 1 of 3 clean-clone runs of make test
# after the scripts destroy their process group, and in 2 of 6 runs before): such a launch is run once more.
TEARDOWN_ABORT = "terminate called without an active exception"


def _ddp_run(command: list[str], tmp_path) -> tuple[dict, list[dict], dict[int, float]]:
    """Runs a 2-process DDP script of tests/ (lightning_ddp_run.py, hf_ddp_run.py): its summary, its offline
    records and each step's true |g_B|^2 over both ranks' micro-batches. A launch that aborted at teardown
    (TEARDOWN_ABORT) is run once more, from clean outputs; any other failure fails at once."""
    import subprocess

    for attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
        if done.returncode == 0 or TEARDOWN_ABORT not in done.stderr:
            break
        for name in ("telemetry.jsonl", "summary.json", "true_grad_sqr.json"):  # the offline records are appended: start clean
            (tmp_path / name).unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-3000:]
    true_grad_sqr = {int(step): value for step, value in json.loads((tmp_path / "true_grad_sqr.json").read_text()).items()}
    return json.loads((tmp_path / "summary.json").read_text()), _jsonl(tmp_path / "telemetry.jsonl"), true_grad_sqr


def _assert_global_batch_statistics(records: list[dict], true_grad_sqr: dict[int, float], rel: float) -> None:
    """Rank 0's records of the scripts' run (2 ranks x micro-batch 16 x accumulation 2, a record every 5 steps):
    at the global batch, at the true gradient's scale (a wrong world or accumulation factor is off by 2x or more)."""
    world, micro_batch, accumulation, every = 2, 16, 2, 5
    batch = world * micro_batch * accumulation
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for record in records:
        assert record["samples"] == record["step"] * batch and record["device_batch"] == micro_batch and record["accumulation"] == accumulation
        window = [true_grad_sqr[step] for step in range(record["step"] - every + 1, record["step"] + 1)]
        assert record["grad_sqr"] + record["trace_sigma"] / batch == pytest.approx(sum(window) / every, rel=rel), record
        assert record["trace_sigma"] > 0


def test_lightning_under_ddp_and_bf16_autocast_gives_the_statistics_of_the_global_batch(dead_server_url, tmp_path):
    """2 gloo processes (Lightning's DDP launcher starts the script again for rank 1), accumulation 2, bf16-mixed
    (Lightning's 16-mixed becomes bf16-mixed on CPU, so the GradScaler path is tested without Lightning, in
    tests/test_reference_logger.py): rank 0 alone writes the records, within bf16's rounding of the truth."""
    script = Path(__file__).with_name("lightning_ddp_run.py")
    summary, records, true_grad_sqr = _ddp_run([sys.executable, str(script), str(tmp_path), dead_server_url, "bf16-mixed"], tmp_path)
    assert summary == {"global_step": 20, "world_size": 2, "dropped_steps": 0, "closed": True, "leader": True, "accumulation": 2}
    _assert_global_batch_statistics(records, true_grad_sqr, rel=1e-2)


def test_hf_trainer_under_ddp_gives_the_statistics_of_the_global_batch(dead_server_url, tmp_path):
    """2 gloo processes started by torchrun, accumulation 2, float32: exact to float rounding."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(Path(__file__).with_name("hf_ddp_run.py")), str(tmp_path), dead_server_url]  # fmt: skip
    summary, records, true_grad_sqr = _ddp_run(command, tmp_path)
    assert summary == {"global_step": 20, "world_size": 2, "dropped_steps": 0, "clipped_steps": 0, "closed": True, "leader": True,
                       "accumulation": 2}  # fmt: skip
    _assert_global_batch_statistics(records, true_grad_sqr, rel=1e-4)


# -- Hugging Face Trainer --------------------------------------------------------------------------------


class _ItemsLoss(MeanLoss):
    """forward with **kwargs, loss normalized by num_items_in_batch (as Transformers' models do): the Trainer does not divide."""

    def forward(self, x, labels, num_items_in_batch=None, **kwargs):
        logits = self._logits(x, labels)
        return {"loss": F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch, "logits": logits}


class _IgnoresItems(MeanLoss):
    """forward with **kwargs that ignores num_items_in_batch: nothing divides its mean loss."""

    def forward(self, x, labels, **kwargs):
        return super().forward(x, labels)


class _TrueGradient(TrueGradient):
    """TrueGradient that also waits for the advice at the end."""

    def __init__(self, await_advice_of=None):
        super().__init__()
        self.await_advice_of = await_advice_of

    def on_train_end(self, args, state, control, **kwargs):  # called before the Tula callback's (listed after it)
        if self.await_advice_of is not None:
            _await_advice(self.await_advice_of)


def _train_hf(tula: TulaTrainerCallback, tmp_path, micro_batches: int, model: nn.Module | None = None, await_advice: bool = False, **arguments) -> tuple[Trainer, _TrueGradient]:
    truth = _TrueGradient(tula if await_advice else None)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=MICRO_BATCH,
                             learning_rate=0.01, logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                             remove_unused_columns=False, disable_tqdm=True, seed=0,
                             **{"gradient_accumulation_steps": ACCUMULATION, "max_grad_norm": 100.0, "num_train_epochs": 1, **arguments})  # fmt: skip
    trainer = Trainer(model=model or MeanLoss(), args=args, train_dataset=Samples(micro_batches), callbacks=[truth, tula])
    trainer.train()
    return trainer, truth


def test_hf_trainer_run_sends_telemetry_gets_advice_and_closes(run_on_server, tmp_path):
    server, run_id = run_on_server
    tula = TulaTrainerCallback(server.url, run_id, every=EVERY, plan_every_s=0.2)
    trainer, truth = _train_hf(tula, tmp_path, STEPS * ACCUMULATION, await_advice=True)
    assert trainer.state.global_step == STEPS and tula.run.accumulation == ACCUMULATION  # from args.gradient_accumulation_steps
    records = _server_records(server, run_id)
    _assert_statistics(records, [10, 20, 30, 40])
    _assert_true_scale(records, truth.true_grad_sqr)
    assert all(r["loss"] > 0 and r["step_time_s"] > 0 for r in records)  # the Trainer logs every 5 steps
    assert records[0]["precond_grad_sqr"] is not None  # the AdamW inside accelerate's wrapper
    assert tula.closed and tula.run.sent == 4 and tula.run.buffered == 0 and tula.dropped_steps == tula.clipped_steps == 0
    assert tula.advice is not None and tula.advice["run_id"] == run_id and "config" in tula.advice
    view = httpx.get(f"{server.url}/v1/runs/{run_id}", timeout=10).json()
    assert view["records"] == 4 and view["last_step"] == STEPS


def test_hf_trainer_with_a_dead_server_trains_on_and_keeps_the_records_offline(dead_server_url, tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tula = TulaTrainerCallback(dead_server_url, "run-1", every=EVERY, offline_path=path, timeout_s=0.2, flush_timeout_s=0.2, plan_every_s=3600)
    trainer, truth = _train_hf(tula, tmp_path, 41, max_steps=42)  # two epochs, each ending with a one-micro-batch step: 21 and 42, left out
    assert trainer.state.global_step == 42 and tula.dropped_steps == 2
    records = _jsonl(path)
    _assert_statistics(records, [10, 20, 31, 41])  # the Trainer's step numbers, across the gap
    _assert_true_scale(records, truth.true_grad_sqr, dropped=frozenset({21, 42}))
    assert tula.closed and tula.run.sent == 0 and tula.run.failed_posts >= 1 and tula.advice is None


def test_hf_trainer_on_one_device_without_accumulation_is_refused_before_training_with_its_own_fix(tmp_path):
    tula = TulaTrainerCallback(None, "run-1", offline_path=tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match=r"nothing to compare. Train with TrainingArguments\(gradient_accumulation_steps=2\)"):
        _train_hf(tula, tmp_path, 8, gradient_accumulation_steps=1)
    assert tula.run is None and not (tmp_path / "t.jsonl").exists()


def test_hf_callback_passes_sampling_and_the_overhead_budget_to_its_run(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tula = TulaTrainerCallback(None, "run-1", every=EVERY, offline_path=path, sample_every=4, overhead_budget=0.5, post_every_s=0.5)
    _train_hf(tula, tmp_path, STEPS * ACCUMULATION)
    _assert_sampling_options_reach_the_run(tula, _jsonl(path))


@pytest.mark.parametrize(
    ("model_class", "divided", "too_large_by"),
    [(_ItemsLoss, None, 1), (_IgnoresItems, False, 1), (_IgnoresItems, None, ACCUMULATION**2)],
    ids=["num-items-normalized", "ignores-num-items-said-so", "ignores-num-items-default-is-wrong"],
)
def test_hf_statistics_are_at_the_true_gradient_scale_whoever_divides_the_loss(tmp_path, model_class, divided, too_large_by):
    path = tmp_path / "telemetry.jsonl"
    tula = TulaTrainerCallback(None, "run-1", every=EVERY, offline_path=path, loss_divided_by_accumulation=divided)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, truth = _train_hf(tula, tmp_path, 20 * ACCUMULATION, model=model_class())
    assert any("num_items_in_batch" in str(w.message) for w in caught) == (divided is None)  # the model takes **kwargs: said, or warned
    records = _jsonl(path)
    _assert_statistics(records, [10, 20])
    scaled = [{**r, "grad_sqr": r["grad_sqr"] / too_large_by, "trace_sigma": r["trace_sigma"] / too_large_by} for r in records]
    _assert_true_scale(scaled, truth.true_grad_sqr)


def test_hf_clipped_steps_are_left_out_of_the_statistics(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tula = TulaTrainerCallback(None, "run-1", every=EVERY, offline_path=path)
    trainer, _ = _train_hf(tula, tmp_path, 20 * ACCUMULATION, max_grad_norm=1e-6)  # every step is clipped
    assert trainer.state.global_step == 20 and tula.clipped_steps == 20
    records = _jsonl(path)  # no window had a step its statistics could use: each sends its counts and step time only
    assert [r["step"] for r in records] == [10, 20]
    assert all(r["step_time_s"] > 0 and r["samples"] > 0 and "grad_sqr" not in r and "trace_sigma" not in r for r in records)

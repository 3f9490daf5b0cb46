"""The Lightning and Hugging Face callbacks (profiler.integrations) in real tiny training runs on CPU: telemetry
reaches a real server at the trainer's step numbers, advice comes back, the run closes; a dead server costs
the training nothing and the offline JSONL holds the records; an epoch's partial accumulation step is left
out; and the statistics are at the true gradient's scale, checked against the gradient of the step's mean
loss recomputed here (|G|^2 + tr(Sigma)/B is the mean of |g_B|^2 over a window's steps, exactly)."""

import json
import math
import socket
import time
import warnings

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from profiler.integrations.huggingface import TulaTrainerCallback  # noqa: E402
from profiler.integrations.lightning import TulaLightningCallback  # noqa: E402
from profiler.tula_run import TulaRun  # noqa: E402
from tests.api_fixtures import run_on_a_server  # noqa: E402

FEATURES, MICRO_BATCH, ACCUMULATION, EVERY, STEPS = 8, 16, 2, 10, 40
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


def _data(micro_batches: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batches * MICRO_BATCH, FEATURES, generator=generator)
    return x, (x[:, 0] + 0.5 * torch.randn(len(x), generator=generator) > 0).long()


def _true_grad_sqr(linear: nn.Linear, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """|g_B|^2 of the step's mean loss over all its samples, on copies of the parameters (no hook sees it)."""
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    weight, bias = linear.weight.detach().clone().requires_grad_(), linear.bias.detach().clone().requires_grad_()
    grads = torch.autograd.grad(F.cross_entropy(x @ weight.T + bias, y), (weight, bias))
    return float(sum(g.square().sum() for g in grads))


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


class _LightningClassifier(lightning.LightningModule):
    """training_step never calls self(x), as many modules do: the callback must see the batches by itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(FEATURES, 2)
        self.micro_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.true_grad_sqr: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.micro_batches.append((x, y))
        return F.cross_entropy(self.linear(x), y)

    def on_before_optimizer_step(self, optimizer):  # after the callbacks' hook, before optimizer.step()
        self.true_grad_sqr[self.trainer.global_step + 1] = _true_grad_sqr(self.linear, self.micro_batches)
        self.micro_batches = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _AwaitAdviceAtTrainEnd(lightning.Callback):
    def __init__(self, tula):
        self.tula = tula

    def on_train_end(self, trainer, pl_module):  # before the Tula callback closes the run at on_fit_end
        _await_advice(self.tula)


def _fit_lightning(tula: TulaLightningCallback, micro_batches: int, *callbacks, epochs: int = 1) -> tuple[lightning.Trainer, _LightningClassifier]:
    module = _LightningClassifier()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(micro_batches)), batch_size=MICRO_BATCH)
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


# -- Hugging Face Trainer --------------------------------------------------------------------------------


class _MeanLoss(nn.Module):
    """forward without **kwargs: the Trainer divides the mean loss by gradient_accumulation_steps itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(FEATURES, 2)
        self.micro_batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x, labels):
        logits = self._logits(x, labels)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    def _logits(self, x, labels):
        if torch.is_grad_enabled():
            self.micro_batches.append((x, labels))
        return self.linear(x)


class _ItemsLoss(_MeanLoss):
    """forward with **kwargs, loss normalized by num_items_in_batch (as Transformers' models do): the Trainer does not divide."""

    def forward(self, x, labels, num_items_in_batch=None, **kwargs):
        logits = self._logits(x, labels)
        return {"loss": F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch, "logits": logits}


class _IgnoresItems(_MeanLoss):
    """forward with **kwargs that ignores num_items_in_batch: nothing divides its mean loss."""

    def forward(self, x, labels, **kwargs):
        return super().forward(x, labels)


class _Samples(torch.utils.data.Dataset):
    def __init__(self, micro_batches: int):
        self.x, self.y = _data(micro_batches)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "labels": self.y[index]}


class _TrueGradient(TrainerCallback):
    """Recomputes each step's |g_B|^2 from the micro-batches the model saw; waits for the advice at the end."""

    def __init__(self, await_advice_of=None):
        self.await_advice_of, self.true_grad_sqr = await_advice_of, {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.true_grad_sqr[state.global_step + 1] = _true_grad_sqr(model.linear, model.micro_batches)
        model.micro_batches = []

    def on_train_end(self, args, state, control, **kwargs):  # called before the Tula callback's (listed after it)
        if self.await_advice_of is not None:
            _await_advice(self.await_advice_of)


def _train_hf(tula: TulaTrainerCallback, tmp_path, micro_batches: int, model: nn.Module | None = None, await_advice: bool = False, **arguments) -> tuple[Trainer, _TrueGradient]:
    truth = _TrueGradient(tula if await_advice else None)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
                             learning_rate=0.01, logging_steps=5, report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, seed=0, **{"max_grad_norm": 100.0, "num_train_epochs": 1, **arguments})  # fmt: skip
    trainer = Trainer(model=model or _MeanLoss(), args=args, train_dataset=_Samples(micro_batches), callbacks=[truth, tula])
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
    assert _jsonl(path) == []  # no window had a step its statistics could use

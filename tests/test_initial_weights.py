"""A fine-tuning job's initial_weights: refused at submit outside the data roots, loaded strictly by the worker
(every point and the pilot start from them), and a file that does not fit fails the point with a reason."""

import json
import subprocess
import sys

import pydantic
import pytest

torch = pytest.importorskip("torch")

from models.initial_weights import load_initial_weights, state_dict_problem  # noqa: E402
from models.workload import build_workload  # noqa: E402
from profiler.pilot import run_pilot  # noqa: E402
from tests.handmade import spec_dict  # noqa: E402
from tula_service.dispatch.jobs import pilot_request, point_request  # noqa: E402
from tula_service.spec.job_spec import JobSpec  # noqa: E402

MNIST1D = {"name": "mnist1d", "num_samples": 2000}


def _request(root, weights: str | None = None, **extra) -> dict:
    return {"model": "mlp1d", "dataset": dict(MNIST1D), "data_roots": [str(root)], "initial_weights": weights, **extra}


def _pretrained(root, steps: int = 150) -> tuple[str, dict]:
    """The MLP trained for `steps` Adam steps at batch 64 (seed 7: not the points' seeded init), saved as a user would."""
    workload = build_workload(_request(root, seed=7))
    model, generator = workload.model, torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        inputs, targets = workload.data.batch(64, generator)
        optimizer.zero_grad()
        workload.loss_fn(model(inputs), targets).backward()
        optimizer.step()
    path = root / "pretrained" / "mlp.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    torch.save(state, path)
    return str(path), state


def test_the_workload_starts_from_the_initial_weights_not_the_seeded_init(tmp_path):
    path, state = _pretrained(tmp_path)
    loaded = build_workload(_request(tmp_path, path)).model.state_dict()
    seeded = build_workload(_request(tmp_path)).model.state_dict()
    assert all(torch.equal(loaded[key], state[key]) for key in state)
    assert not all(torch.equal(seeded[key], state[key]) for key in state)


def test_a_state_dict_saved_from_a_ddp_wrapper_loads_without_its_module_prefix(tmp_path):
    _, state = _pretrained(tmp_path, steps=1)
    path = tmp_path / "ddp.pt"
    torch.save({f"module.{key}": value for key, value in state.items()}, path)
    loaded = build_workload(_request(tmp_path, str(path))).model.state_dict()
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_weights_of_another_model_name_the_keys_and_shapes_that_do_not_fit(tmp_path):
    path, _ = _pretrained(tmp_path, steps=1)
    with pytest.raises(ValueError, match=r"another shape: layers\.0\.weight \(100, 40\) for \(32, 40\)"):
        build_workload({**_request(tmp_path, path), "model_options": {"hidden": 32}})
    model = build_workload(_request(tmp_path)).model
    expected = model.state_dict()
    problem = state_dict_problem({"head.weight": torch.zeros(2)}, expected)
    assert "missing layers.0.bias" in problem and "and 1 more" in problem and "unexpected head.weight" in problem
    assert "not a state dict" in state_dict_problem([torch.zeros(2)], expected)


def test_a_file_that_is_not_a_plain_state_dict_is_refused_without_running_its_pickle(tmp_path):
    model = build_workload(_request(tmp_path)).model
    whole = tmp_path / "whole_model.pt"
    torch.save(model, whole)  # the module pickled: weights_only refuses to build it
    with pytest.raises(ValueError, match=r"does not load with torch\.load\(weights_only=True\)"):
        load_initial_weights(model, str(whole), [str(tmp_path)])
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), tensor)
    with pytest.raises(ValueError, match="is not a state dict"):
        load_initial_weights(model, str(tensor), [str(tmp_path)])


def test_the_worker_reads_weights_only_under_a_data_root(tmp_path):
    path, _ = _pretrained(tmp_path / "data", steps=1)
    model = build_workload(_request(tmp_path / "data")).model
    with pytest.raises(PermissionError, match="outside the data roots"):
        load_initial_weights(model, path, [str(tmp_path / "other")])
    with pytest.raises(FileNotFoundError, match="does not exist on this worker"):
        load_initial_weights(model, str(tmp_path / "data" / "missing.pt"), [str(tmp_path / "data")])


def _spec(weights: str | None) -> dict:
    return spec_dict(model="mlp1d", dataset=dict(MNIST1D), model_options={}, initial_weights=weights)


def test_the_spec_refuses_initial_weights_outside_the_data_roots_at_their_field(monkeypatch):
    monkeypatch.setenv("TULA_DATA_ROOTS", "/data")
    assert JobSpec.model_validate(_spec("/data/checkpoints/mlp.pt")).initial_weights == "/data/checkpoints/mlp.pt"
    for path, says in (("/etc/passwd", "outside the data roots (/data)"), ("mlp.pt", "must be absolute")):
        with pytest.raises(pydantic.ValidationError) as caught:
            JobSpec.model_validate(_spec(path))
        [error] = caught.value.errors()
        assert error["loc"] == ("initial_weights",) and says in error["msg"]
    monkeypatch.delenv("TULA_DATA_ROOTS")
    with pytest.raises(pydantic.ValidationError, match="no data root is configured"):
        JobSpec.model_validate(_spec("/data/checkpoints/mlp.pt"))


def test_points_and_the_pilot_are_asked_to_start_from_the_spec_weights(monkeypatch):
    monkeypatch.setenv("TULA_DATA_ROOTS", "/data")
    spec = JobSpec.model_validate(_spec("/data/checkpoints/mlp.pt"))
    assert point_request(spec, 32)["initial_weights"] == "/data/checkpoints/mlp.pt"
    assert pilot_request(spec)["initial_weights"] == "/data/checkpoints/mlp.pt"


def _pilot(root, weights: str | None) -> dict:
    return run_pilot({**_request(root, weights), "batch_size": 64, "device": "cpu", "threads": 1, "optimizer": "adam",
                      "lr": 1e-3, "pilot_steps": 40, "pilot_seconds": 60, "pilot_record_every": 5})  # fmt: skip


def test_the_pilot_trains_on_from_the_checkpoint_and_says_so(tmp_path):
    path, _ = _pretrained(tmp_path)
    fine_tuning, from_scratch = _pilot(tmp_path, path), _pilot(tmp_path, None)
    assert fine_tuning["status"] == from_scratch["status"] == "ok"
    assert fine_tuning["initial_weights"] == path and from_scratch["initial_weights"] is None
    # the checkpoint's loss, well below a random init's log(10) = 2.30 nats, from the first record on
    first = fine_tuning["trajectory"][0]["loss"], from_scratch["trajectory"][0]["loss"]
    assert first[0] < 0.8 * first[1], first


def test_a_point_whose_weights_do_not_fit_fails_with_the_reason_as_data(tmp_path):
    path, _ = _pretrained(tmp_path, steps=1)
    request = {**_request(tmp_path, path), "model_options": {"hidden": 32}, "batch_size": 16, "device": "cpu",
               "warmup_iters": 1, "timed_iters": 2, "grad_iters": 1, "time_cap_s": 5}  # fmt: skip
    out = tmp_path / "point.json"
    done = subprocess.run([sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    record = json.loads(out.read_text())
    assert done.returncode == 0 and record["status"] == "failed"
    assert "initial_weights" in record["error"] and "another shape" in record["error"]

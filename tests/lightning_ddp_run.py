"""A tiny Lightning run under DDP on CPU (2 gloo processes) with the Tula callback, for tests/test_integrations.py.

Lightning's DDP launcher starts this script again for rank 1, so it runs as a script, not inside pytest:

    python tests/lightning_ddp_run.py OUT_DIR DEAD_SERVER_URL PRECISION

Each rank trains on its half of the data (DistributedSampler) with accumulation; the callback's records go to
OUT_DIR/telemetry.jsonl (rank 0, offline: the server is dead). Rank 0 writes each optimizer step's true
|g_B|^2 over both ranks' micro-batches (tests/integration_models.py) to OUT_DIR/true_grad_sqr.json and the
run's summary to OUT_DIR/summary.json."""

import json
import sys
from pathlib import Path

import lightning
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from profiler.integrations.lightning import TulaLightningCallback  # noqa: E402
from tests.integration_models import MICRO_BATCH, LightningClassifier, data  # noqa: E402

ACCUMULATION, EVERY, WORLD, STEPS = 2, 5, 2, 20


def main(out_dir: str, server: str, precision: str) -> None:
    out = Path(out_dir)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data(STEPS * ACCUMULATION * WORLD)), batch_size=MICRO_BATCH)
    tula = TulaLightningCallback(server, "run-ddp", every=EVERY, offline_path=out / "telemetry.jsonl", timeout_s=0.2,
                                 flush_timeout_s=0.2, plan_every_s=3600)  # fmt: skip
    trainer = lightning.Trainer(max_epochs=1, accumulate_grad_batches=ACCUMULATION, accelerator="cpu", devices=WORLD, strategy="ddp",
                                precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[tula])  # fmt: skip
    module = LightningClassifier()
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        (out / "true_grad_sqr.json").write_text(json.dumps(module.true_grad_sqr))
        summary = {"global_step": trainer.global_step, "world_size": trainer.world_size, "dropped_steps": tula.dropped_steps,
                   "closed": tula.closed, "leader": tula.run.leader, "accumulation": tula.run.accumulation}  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary))
    if dist.is_initialized():  # left alive, gloo's threads can abort the exit ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""A tiny Hugging Face Trainer run under DDP on CPU (2 gloo processes) with the Tula callback, for
tests/test_integrations.py. Started by torchrun, one process per rank:

    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT tests/hf_ddp_run.py OUT_DIR DEAD_SERVER_URL

Each rank trains on its share of the data with accumulation; the callback's records go to OUT_DIR/telemetry.jsonl
(rank 0, offline: the server is dead). Rank 0 writes each optimizer step's true |g_B|^2 over both ranks'
micro-batches (tests/integration_models.py) to OUT_DIR/true_grad_sqr.json and the run's summary to
OUT_DIR/summary.json."""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import Trainer, TrainingArguments

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from profiler.integrations.huggingface import TulaTrainerCallback  # noqa: E402
from tests.integration_models import MICRO_BATCH, MeanLoss, Samples, TrueGradient  # noqa: E402

ACCUMULATION, EVERY, WORLD, STEPS = 2, 5, 2, 20


def main(out_dir: str, server: str) -> None:
    out = Path(out_dir)
    truth = TrueGradient()
    tula = TulaTrainerCallback(server, "run-ddp", every=EVERY, offline_path=out / "telemetry.jsonl", timeout_s=0.2, flush_timeout_s=0.2,
                               plan_every_s=3600)  # fmt: skip
    args = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
                             learning_rate=0.01, report_to=[], save_strategy="no", use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
                             remove_unused_columns=False, disable_tqdm=True, seed=0, max_grad_norm=100.0, num_train_epochs=1)  # fmt: skip
    trainer = Trainer(model=MeanLoss(), args=args, train_dataset=Samples(STEPS * ACCUMULATION * WORLD), callbacks=[truth, tula])
    tula.trainer = trainer  # under DDP the statistics need the DistributedDataParallel wrapper
    trainer.train()
    if dist.get_rank() == 0:
        (out / "true_grad_sqr.json").write_text(json.dumps(truth.true_grad_sqr))
        summary = {"global_step": trainer.state.global_step, "world_size": dist.get_world_size(), "dropped_steps": tula.dropped_steps,
                   "clipped_steps": tula.clipped_steps, "closed": tula.closed, "leader": tula.run.leader, "accumulation": tula.run.accumulation}  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary))
    if dist.is_initialized():  # left alive, gloo's threads can abort the exit ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

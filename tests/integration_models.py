"""The tiny models and data of the integration tests (tests/test_integrations.py) and of their DDP scripts
(tests/lightning_ddp_run.py, tests/hf_ddp_run.py): a linear classifier that keeps each optimizer step's
micro-batches, so that the step's true |g_B|^2 can be recomputed from them, over every rank's under DDP."""

import lightning
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from transformers import TrainerCallback

FEATURES, MICRO_BATCH = 8, 16


def data(micro_batches: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batches * MICRO_BATCH, FEATURES, generator=generator)
    return x, (x[:, 0] + 0.5 * torch.randn(len(x), generator=generator) > 0).long()


def _all_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor, or under torch.distributed every rank's, concatenated in rank order."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def true_grad_sqr(linear: nn.Linear, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """|g_B|^2 of the step's mean loss over all its samples (all ranks' under DDP: a collective, every rank
    calls it), in float32 on copies of the parameters (no hook sees it)."""
    x = torch.cat([_all_ranks(b[0]) for b in batches]).float()
    y = torch.cat([_all_ranks(b[1]) for b in batches])
    weight, bias = linear.weight.detach().float().clone().requires_grad_(), linear.bias.detach().float().clone().requires_grad_()
    grads = torch.autograd.grad(F.cross_entropy(x @ weight.T + bias, y), (weight, bias))
    return float(sum(g.square().sum() for g in grads))


class LightningClassifier(lightning.LightningModule):
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
        self.true_grad_sqr[self.trainer.global_step + 1] = true_grad_sqr(self.linear, self.micro_batches)
        self.micro_batches = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class MeanLoss(nn.Module):
    """A Hugging Face model whose forward takes no **kwargs: the Trainer divides the mean loss by
    gradient_accumulation_steps itself."""

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


class Samples(torch.utils.data.Dataset):
    """data(micro_batches) as the Trainer's dict samples."""

    def __init__(self, micro_batches: int):
        self.x, self.y = data(micro_batches)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "labels": self.y[index]}


class TrueGradient(TrainerCallback):
    """Recomputes each optimizer step's |g_B|^2 from the micro-batches the model saw (every rank's under DDP)."""

    def __init__(self):
        self.true_grad_sqr: dict[int, float] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.true_grad_sqr[state.global_step + 1] = true_grad_sqr(model.linear, model.micro_batches)
        model.micro_batches = []

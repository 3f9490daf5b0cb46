"""Generated datasets: learnable structure from a fixed random teacher, drawn on the fly (nothing downloaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUCCESSORS_PER_TOKEN = 8  # support of each row of the Markov chain: the next token has at most 8 choices


class SyntheticImages:
    """x ~ N(0, 1) of shape (channels, size, size); the label is the argmax of a fixed random linear
    "teacher" applied to the 4x4 average-pooled image, so the task is learnable and the gradient has a
    real signal component (the noise scale is finite), not pure label noise."""

    input_kind = "image"

    def __init__(self, *, channels: int, image_size: int, num_classes: int, seed: int = 0):
        self.channels = channels
        self.image_size = image_size
        self.num_classes = num_classes
        teacher_gen = torch.Generator().manual_seed(10_000 + seed)
        self._teacher = torch.randn(num_classes, channels * 16, generator=teacher_gen)

    @property
    def shape(self) -> dict[str, int]:
        return {"in_channels": self.channels, "image_size": self.image_size, "num_classes": self.num_classes}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(batch_size, self.channels, self.image_size, self.image_size, generator=generator)
        pooled = F.adaptive_avg_pool2d(images, 4).flatten(1)
        labels = (pooled @ self._teacher.T).argmax(dim=1)
        return images, labels


class SyntheticTokens:
    """Sequences from a fixed random sparse Markov chain over `vocab_size` tokens.

    The chain is drawn once from the seed: token v may be followed by SUCCESSORS_PER_TOKEN random
    tokens, with probabilities softmax(2 * z), z ~ N(0, 1). A sequence starts at a uniform token and
    walks the chain for seq_len steps, so the next-token entropy is at most log(8) nats (far below
    log(vocab_size)): a language model has something real to learn. Input = tokens[:-1], target = tokens[1:].
    """

    input_kind = "tokens"

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        chain_gen = torch.Generator().manual_seed(20_000 + seed)
        successors = min(SUCCESSORS_PER_TOKEN, vocab_size)
        self.successors = torch.randint(0, vocab_size, (vocab_size, successors), generator=chain_gen)
        self.successor_probs = torch.softmax(2 * torch.randn(vocab_size, successors, generator=chain_gen), dim=1)

    @property
    def shape(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
        for position in range(1, self.seq_len + 1):
            previous = tokens[:, position - 1]
            choice = torch.multinomial(self.successor_probs[previous], 1, generator=generator)
            tokens[:, position] = self.successors[previous].gather(1, choice).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]

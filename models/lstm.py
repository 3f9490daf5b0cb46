"""An LSTM language model (Hochreiter & Schmidhuber 1997), the recurrent counterpart of models.gpt: token ids
(batch, seq_len) -> next-token logits (batch, seq_len, vocab_size), as a character-level LM reads text (Graves 2013,
"Generating Sequences With Recurrent Neural Networks", sec. 3: embedding, stacked LSTM, linear softmax head)."""

from __future__ import annotations

import torch
from torch import nn


class LSTMLanguageModel(nn.Module):
    """Embedding of `width` -> `layers` LSTM layers of `width` units -> linear head over the vocabulary. The recurrence
    runs seq_len sequential steps, so its step time grows with the sequence, not only with the batch; no position
    embedding (the recurrence orders the tokens), so any sequence up to seq_len is read."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 64, layers: int = 1):
        super().__init__()
        if width < 1 or layers < 1:
            raise ValueError(f"lstm_lm needs width >= 1 and layers >= 1 (got width={width}, layers={layers})")
        self.seq_len = seq_len
        self.embedding = nn.Embedding(vocab_size, width)
        self.lstm = nn.LSTM(input_size=width, hidden_size=width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the model's seq_len {self.seq_len}")
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.head(hidden)

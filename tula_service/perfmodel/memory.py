"""Peak device memory as a line in the per-device batch.

    M(b) = static_bytes + act_bytes_per_sample * b

static = weights + gradients + optimizer state (+ workspace); activations grow with b
(Tula seed paper, Fig. 4a/4b). Fitted by ordinary least squares on the profiled points.
"""

from __future__ import annotations

import numpy as np

MAX_DEVICE_BATCH = 2**40  # stands for 'unbounded by memory' when activations cost nothing


class MemoryModel:
    def fit(self, device_batch: np.ndarray, peak_bytes: np.ndarray) -> MemoryModel:
        x, y = np.asarray(device_batch, dtype=float), np.asarray(peak_bytes, dtype=float)
        self.act_bytes_per_sample_, self.static_bytes_ = np.polyfit(x, y, 1)
        residual = y - self.predict(x)
        total = np.sum((y - y.mean()) ** 2)
        self.r2_ = float(1.0 - np.sum(residual**2) / total) if total > 0 else 1.0
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return self.static_bytes_ + self.act_bytes_per_sample_ * np.asarray(device_batch, dtype=float)

    def max_device_batch(self, capacity_bytes: float, margin: float = 0.05) -> int:
        """Largest b with M(b) <= capacity * (1 - margin); 0 when even the static part does not fit."""
        usable = capacity_bytes * (1.0 - margin) - self.static_bytes_
        if usable < 0:
            return 0
        if self.act_bytes_per_sample_ <= 0:
            return MAX_DEVICE_BATCH
        return int(usable // self.act_bytes_per_sample_)

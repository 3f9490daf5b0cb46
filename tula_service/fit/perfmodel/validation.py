"""Leave-one-out prediction error: every recommendation quotes it for time and memory."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def leave_one_out_relative_errors(
    make_model: Callable[[], object], x: np.ndarray, y: np.ndarray, min_points: int = 3
) -> list[float]:
    """|predict(x_i) - y_i| / y_i for a model fitted without point i; empty when too few points."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < min_points:
        return []
    errors = []
    for held_out in range(x.size):
        keep = np.arange(x.size) != held_out
        model = make_model().fit(x[keep], y[keep])
        predicted = float(np.asarray(model.predict(x[held_out : held_out + 1]))[0])
        errors.append(abs(predicted - y[held_out]) / abs(y[held_out]))
    return errors


def error_summary(relative_errors: list[float]) -> dict[str, float | int | None]:
    if not relative_errors:
        return {"median_rel_err": None, "max_rel_err": None, "points": 0}
    return {
        "median_rel_err": float(np.median(relative_errors)),
        "max_rel_err": float(np.max(relative_errors)),
        "points": len(relative_errors),
    }

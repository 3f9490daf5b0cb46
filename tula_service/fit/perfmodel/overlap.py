"""How much gradient communication hides behind computation.

    T_iter = (T_comp^g + T_net^g)^(1/g),   g in [1, 10]

g = 1 is no overlap (the sum, conservative); as g grows T_iter tends to max(T_comp, T_net) (perfect
overlap). The form and its fit are Pollux/AdaptDL's (Qiao et al., OSDI 2021; `adaptdl/goodput.py`):
g is fitted by bounded scalar minimization of the RMSE of log iteration times.

g can only be learned from iteration times measured on several devices, where T_net > 0: single-device
points carry no communication and say nothing about overlap, so they are dropped. Without such data g
stays at the conservative default 1 with `source_ == "assumed"`.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize_scalar

G_BOUNDS = (1.0, 10.0)


def _combine(t_comp_s: np.ndarray, t_net_s: np.ndarray, g: float) -> np.ndarray:
    """(a^g + b^g)^(1/g) computed as top * ((a/top)^g + (b/top)^g)^(1/g), which cannot overflow."""
    if g == 1.0:
        return t_comp_s + t_net_s  # exactly the no-overlap sum
    top = np.maximum(t_comp_s, t_net_s)
    scale = np.where(top > 0, top, 1.0)
    return top * ((t_comp_s / scale) ** g + (t_net_s / scale) ** g) ** (1.0 / g)


class OverlapModel:
    def __init__(self, g: float = 1.0):
        if not G_BOUNDS[0] <= g <= G_BOUNDS[1]:
            raise ValueError(f"g must be in [{G_BOUNDS[0]:g}, {G_BOUNDS[1]:g}], got {g}")
        self.g = g
        self.g_ = float(g)
        self.source_ = "assumed"
        self.n_points_ = 0
        self.log_rmse_: float | None = None

    def combine(self, t_comp_s: np.ndarray | float, t_net_s: np.ndarray | float) -> np.ndarray:
        """Iteration seconds from compute and communication seconds, broadcast over both."""
        return _combine(np.asarray(t_comp_s, dtype=float), np.asarray(t_net_s, dtype=float), self.g_)

    def fit(self, t_comp_s: np.ndarray, t_net_s: np.ndarray, t_iter_s: np.ndarray) -> OverlapModel:
        """Fit g to multi-device measurements; keeps the default (source "assumed") when none inform it."""
        arrays = (np.asarray(values, dtype=float).ravel() for values in (t_comp_s, t_net_s, t_iter_s))
        comp, net, measured = np.broadcast_arrays(*arrays)
        keep = (comp > 0) & (net > 0) & (measured > 0)
        comp, net, log_measured = comp[keep], net[keep], np.log(measured[keep])
        self.n_points_ = int(log_measured.size)
        if self.n_points_ == 0:
            return self

        def log_rmse(g: float) -> float:
            return float(np.sqrt(np.mean((np.log(_combine(comp, net, g)) - log_measured) ** 2)))

        result = minimize_scalar(log_rmse, bounds=G_BOUNDS, method="bounded", options={"xatol": 1e-6})
        self.g_, self.log_rmse_, self.source_ = float(result.x), float(result.fun), "fitted"
        return self

"""Placement-aware step time on several GPUs over several nodes, fitted to measured multi-device steps.

    T_step(p, b) = ( T_c(b)^gamma + T_r(p)^gamma )^(1/gamma) + kappa (g - 1) T_c(b),   gamma in [1, 10], kappa in [0, 1]
    T_r(p)       = ring(g, S, intra) + [m > 1] * ring(m, S / g, inter)             (hierarchical)
                 = ring(g, S, intra) if m == 1 else ring(n, S, inter)          (flat)
    ring(n, S, link) = 2 (n - 1) * latency_s + 2 (n - 1) / n * S / bandwidth

for a placement p = (GPUs on node 1, GPUs on node 2, ...) with n GPUs on m nodes, g on the busiest node,
and a per-GPU batch b. Sources: the overlap p-norm and "fit the throughput model to measured steps" are
Pollux's (Qiao et al., OSDI 2021, sec. 3.2; `adaptdl/goodput.py`); the ring cost is Patarasuk & Yuan
2009 and Thakur, Rabenseifner & Gropp 2005 (2(n-1) hops, 2(n-1)/n S bytes per device).

Topologies:
- hierarchical: reduce-scatter inside the node, all-reduce a 1/g shard across nodes
                (`network.HierarchicalAllReduce`, Jia et al. 2018): sync(22) < sync(11).
- flat:         one ring over all n GPUs, every hop paced by the inter-node link once m > 1. The GPUs of a
                node share its NIC, and a ring crossing m nodes sends 2 (n - 1) / n S bytes through each
                NIC however many of the node's GPUs it visits.
A topology with g rings' worth of bytes through a node's NIC (inter-node cost growing with g) was a
candidate until 2026-12-02, to explain an exposed sync of 22 at 1.7-2.8x that of 11 on the Pollux traces
(cifar10). That ratio is mostly the overlap's: 1.7-2.2 at batches 32-91, where little of the all-reduce is
hidden (a flat ring says 1.5, plus the wait for each node's slower GPU), 2.8 at 182 and 9.6 at 257. It was
never chosen from rich data (30% of all rows, 5 seeds, both applications), was chosen in 5 of 10 sparse
fits (6 placements at one or two batches, gamma assumed 2), and then missed the other rows by 14-84% where a
ring topology missed by 6-16% (docs/validation.md).

kappa (g - 1) T_c(b) is host contention, a straggler's wait: the g GPUs of a node share its PCIe root and
CPUs, the slowest of them falls behind by a share of its compute, and the others wait for it in the
all-reduce, where no backward pass is left to hide the wait (kappa = 0 is "none"). So the wait is added
outside the overlap, and the compute part T - sync is T_c(b) itself. On the Pollux traces (cifar10) the
exposed sync of one node with 4 GPUs grows with the batch, 0.014 s at 32 to 0.09 s at 1024, while 4
nodes with one GPU each stay at 0.003 s from 257 up; the compute part does not grow with g. T_c(b) is
the single-device compute model chosen by `select_compute_model`. One accumulation micro-step costs
(1 + kappa (g - 1)) T_c(b): the straggler falls behind on every micro-step (`step_time.MeasuredStepTime`).

gamma is fitted, or assumed to be 2 (`ASSUMED_GAMMA`): at T_r = T_c the p-norm gives 2^(1/gamma) T_c, from
2 T_c (gamma = 1, no overlap) to T_c (gamma -> inf, perfect overlap); 1/gamma = 1/2 is the midpoint, the
value whose worst-case log error over all gammas is smallest. It is not identifiable from rows at one
per-GPU batch, where gamma and the links trade off exactly: there only gamma-assumed shapes compete, and
the report says why.

Fit: latency, bandwidth per link, gamma and kappa together by `scipy.optimize.least_squares` on log
residuals log(T_pred / T_measured) of the multi-device rows (and, where sync_time_s is measured, of
the compute part T - sync against T_c(b)), inside physical bounds. With the all-reduce benchmark
measured on one node's GPUs (`comm_rows`, NCCL) and the gradient's size S known, its points join the fit
as ring(w, M bytes, intra) against the measured seconds, log residuals weighted by sqrt(rows / points) so
that the benchmark, however many points it has, weighs as much as the steps: the intra-node link is then
fitted jointly from both. Each candidate shape
(topology x gamma fitted or assumed x contention or not x latency fitted or assumed) is scored by
its held-out relative step-time error over the multi-device rows, leaving one placement out at a
time (k-fold over placements when there are more than `MAX_LOO_FOLDS`); the lowest median wins, the
shape with fewer free parameters on ties. Too few rows for any shape: the given links, gamma = 2 and
kappa = 0 are used and labelled "assumed".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from tula_service.fit.perfmodel.compute import select_compute_model
from tula_service.fit.perfmodel.network import Link

TOPOLOGIES = ("hierarchical", "flat")
GAMMA_BOUNDS = (1.0, 10.0)
KAPPA_BOUNDS = (0.0, 1.0)
LATENCY_BOUNDS_S = (1e-7, 1e-1)
BANDWIDTH_BOUNDS_GBPS = (0.1, 2000.0)
UNKNOWN_BYTES_TRANSFER_BOUNDS_S = (1e-7, 100.0)  # seconds to move one whole gradient when S is unknown
MAX_LOO_FOLDS = 12
ASSUMED_GAMMA = 2.0  # halfway in 1/gamma between no overlap and perfect overlap (module docstring)
TIE_TOLERANCE = 2e-3  # a richer shape must beat a simpler one by 0.2 percentage point of median error


def parse_placement(placement: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """"22" or (2, 2) -> (2, 2); every node holds at least one GPU."""
    digits = tuple(int(c) for c in placement) if isinstance(placement, str) else tuple(int(g) for g in placement)
    if not digits or min(digits) < 1:
        raise ValueError(f"a placement lists the GPUs used on each node (each >= 1), got {placement!r}")
    return digits


def placement_features(placements) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(g: GPUs on the busiest node, m: nodes, n: GPUs) as float arrays, one entry per placement."""
    parsed = [parse_placement(p) for p in placements]
    return tuple(np.array([f(p) for p in parsed], dtype=float) for f in (max, len, sum))


def packed_features(devices: np.ndarray | int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(g, m, n) of n devices filling nodes in order: g = min(n, gpus_per_node), m = ceil(n / gpus_per_node)."""
    n = np.asarray(devices, dtype=float)
    return np.minimum(n, gpus_per_node), np.ceil(n / gpus_per_node), n


@dataclass(frozen=True)
class StepRow:
    placement: tuple[int, ...]
    device_batch: float
    step_time_s: float
    sync_time_s: float | None = None


@dataclass(frozen=True)
class CommRow:
    """One point of the all-reduce benchmark on one node: `world_size` GPUs all-reduce `message_bytes`."""

    world_size: int
    message_bytes: float
    seconds: float


@dataclass(frozen=True)
class Shape:
    topology: str = "flat"
    overlap: bool = True  # gamma fitted; False: gamma = ASSUMED_GAMMA
    contention: bool = True  # kappa fitted; False: kappa = 0
    fit_latency: bool = True  # latencies fitted; False: the given links' latencies (assumed)

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")

    @property
    def name(self) -> str:
        parts = [self.topology, "gamma_fitted" if self.overlap else "gamma_assumed"]
        parts += ["contention"] if self.contention else []
        parts += [] if self.fit_latency else ["assumed_latency"]
        return "+".join(parts)

    def free(self) -> np.ndarray:
        """Which of (lat_intra, xfer_intra, lat_inter, xfer_inter, gamma, kappa) this shape fits."""
        return np.array([self.fit_latency, True, self.fit_latency, True, self.overlap, self.contention])


CANDIDATE_SHAPES = tuple(
    Shape(topology, overlap, contention, fit_latency)
    for topology in TOPOLOGIES for overlap in (True, False) for contention in (True, False) for fit_latency in (True, False)
)  # fmt: skip


def _ring(devices: np.ndarray, latency_s, transfer_s) -> np.ndarray:
    """ring(n) with transfer_s = S / bandwidth; 0 where n <= 1."""
    hops = 2.0 * (devices - 1.0)
    return np.where(devices > 1, hops * latency_s + hops / np.maximum(devices, 1.0) * transfer_s, 0.0)


def _allreduce_s(topology: str, g, m, n, lat_a, xfer_a, lat_e, xfer_e) -> np.ndarray:
    intra = _ring(g, lat_a, xfer_a)
    if topology == "flat":
        return np.where(m > 1, _ring(n, lat_e, xfer_e), intra)
    return intra + _ring(m, lat_e, xfer_e / g)


def _combine(compute_s: np.ndarray, allreduce_s: np.ndarray, gamma: float) -> np.ndarray:
    """(a^gamma + b^gamma)^(1/gamma) as top * ((a/top)^gamma + (b/top)^gamma)^(1/gamma): no overflow."""
    top = np.maximum(compute_s, allreduce_s)
    scale = np.where(top > 0, top, 1.0)
    return top * ((compute_s / scale) ** gamma + (allreduce_s / scale) ** gamma) ** (1.0 / gamma)


def validate_rows(rows) -> list[StepRow]:
    """StepRow or dict rows -> StepRows; a bad value raises ValueError naming the row and the field."""
    parsed = []
    for index, row in enumerate(rows):
        values = row if isinstance(row, dict) else row.__dict__
        try:
            placement = parse_placement(values["placement"])
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"row {index}: field 'placement': {error}") from None
        numbers = {}
        for name in ("device_batch", "step_time_s", "sync_time_s"):
            value = values.get(name)
            if value is None and name == "sync_time_s":
                numbers[name] = None
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"row {index}: field '{name}' must be a number, got {value!r}") from None
            low_ok = number >= 0 if name == "sync_time_s" else number > 0
            if not (np.isfinite(number) and low_ok):
                raise ValueError(f"row {index}: field '{name}' must be {'>= 0' if name == 'sync_time_s' else 'positive'} and finite, got {number}")
            numbers[name] = number
        if numbers["sync_time_s"] is not None and numbers["sync_time_s"] >= numbers["step_time_s"]:
            raise ValueError(f"row {index}: field 'sync_time_s' ({numbers['sync_time_s']}) must be below step_time_s ({numbers['step_time_s']})")
        parsed.append(StepRow(placement, numbers["device_batch"], numbers["step_time_s"], numbers["sync_time_s"]))
    return parsed


@dataclass
class _Data:
    g: np.ndarray
    m: np.ndarray
    n: np.ndarray
    batch: np.ndarray
    step_s: np.ndarray
    compute_part_s: np.ndarray  # step - sync where sync is measured, else nan
    group: np.ndarray  # placement index, for leaving a placement out

    @classmethod
    def of(cls, rows: list[StepRow]) -> _Data:
        g, m, n = placement_features([r.placement for r in rows])
        _, group = np.unique(["".join(map(str, r.placement)) for r in rows], return_inverse=True)
        part = [r.step_time_s - r.sync_time_s if r.sync_time_s is not None else np.nan for r in rows]
        return cls(g, m, n, np.array([r.device_batch for r in rows], float), np.array([r.step_time_s for r in rows], float),
                   np.array(part, float), group)  # fmt: skip

    def take(self, keep: np.ndarray) -> _Data:
        return _Data(*(getattr(self, f)[keep] for f in ("g", "m", "n", "batch", "step_s", "compute_part_s", "group")))


@dataclass
class PlacementStepModel:
    """`fit(rows)` -> the chosen shape's parameters (`params_`, each with its source); `predict(g, m, n, batch)`.

    `intra` and `inter` are the cluster's links as the spec or the catalog give them (tula_service.fit.links):
    the values a shape that does not fit a latency assumes, and the fallback without multi-device rows."""

    intra: Link
    inter: Link
    gradient_bytes: float | None = None
    shapes: tuple[Shape, ...] = CANDIDATE_SHAPES
    comm_rows: tuple[CommRow, ...] = ()  # the intra-node all-reduce benchmark; used when gradient_bytes is known
    shape_: Shape = field(default=Shape(), init=False)

    # (lat_intra_s, xfer_intra_s, lat_inter_s, xfer_inter_s, gamma, kappa); xfer = S / bandwidth
    def _assumed_vector(self) -> np.ndarray:
        size = self.gradient_bytes if self.gradient_bytes else 1.0  # unknown S: xfer is seconds per gradient
        to_s = lambda link: size * 8.0 / (link.bandwidth_gbps * 1e9)  # noqa: E731
        return np.array([self.intra.latency_s, to_s(self.intra), self.inter.latency_s, to_s(self.inter), ASSUMED_GAMMA, 0.0])

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        if self.gradient_bytes:
            xfer = [self.gradient_bytes * 8.0 / (gbps * 1e9) for gbps in BANDWIDTH_BOUNDS_GBPS[::-1]]
        else:
            xfer = list(UNKNOWN_BYTES_TRANSFER_BOUNDS_S)
        low = [LATENCY_BOUNDS_S[0], xfer[0], LATENCY_BOUNDS_S[0], xfer[0], GAMMA_BOUNDS[0], KAPPA_BOUNDS[0]]
        high = [LATENCY_BOUNDS_S[1], xfer[1], LATENCY_BOUNDS_S[1], xfer[1], GAMMA_BOUNDS[1], KAPPA_BOUNDS[1]]
        return np.array(low), np.array(high)

    def _predict_vector(self, theta, shape: Shape, g, m, n, compute_s) -> np.ndarray:
        lat_a, xfer_a, lat_e, xfer_e, gamma, kappa = theta
        allreduce_s = _allreduce_s(shape.topology, g, m, n, lat_a, xfer_a, lat_e, xfer_e)
        return _combine(compute_s, allreduce_s, gamma) + kappa * (g - 1.0) * compute_s

    def _fit_shape(self, shape: Shape, data: _Data) -> tuple[np.ndarray, float]:
        """Least squares over the shape's free parameters (log-scaled links): (theta, log RMSE)."""
        free, theta0 = shape.free(), self._assumed_vector()
        low, high = self._bounds()
        theta0 = np.clip(theta0, low, high)
        log_scaled = np.array([True, True, True, True, False, False])
        compute_s = self.compute_.predict(data.batch)
        has_part = np.isfinite(data.compute_part_s)
        comm = self._comm_arrays(data.step_s.size)

        def unpack(x):
            theta = theta0.copy()
            theta[free] = np.where(log_scaled[free], np.exp(x), x)
            return theta

        def residuals(x):
            theta = unpack(x)
            step = np.log(self._predict_vector(theta, shape, data.g, data.m, data.n, compute_s) / data.step_s)
            part = np.log(compute_s[has_part] / data.compute_part_s[has_part])
            if comm is None:
                return np.concatenate([step, part])
            world, share, seconds, weight = comm
            benchmark = weight * np.log(_ring(world, theta[0], theta[1] * share) / seconds)
            return np.concatenate([step, part, benchmark])

        to_x = lambda v: np.where(log_scaled[free], np.log(np.where(log_scaled[free], v, 1.0)), v)  # noqa: E731
        lower, upper = to_x(low[free]), to_x(high[free])
        best = None
        for gamma0 in ((1.5, 4.0) if shape.overlap else (1.0,)):
            start = theta0.copy()
            start[4], start[5] = gamma0, 0.05 if shape.contention else 0.0
            x0 = np.clip(to_x(start[free]), lower + 1e-9, upper - 1e-9)
            result = least_squares(residuals, x0, bounds=(lower, upper), method="trf", x_scale=1.0)
            if best is None or result.cost < best.cost:
                best = result
        theta = unpack(best.x)
        return theta, float(np.sqrt(np.mean(residuals(best.x)[: data.step_s.size] ** 2)))

    def _comm_arrays(self, step_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float] | None:
        """(world sizes, message bytes / S, seconds, weight) of the benchmark points; None without them or S."""
        if not self.comm_rows or not self.gradient_bytes:
            return None
        world = np.array([r.world_size for r in self.comm_rows], dtype=float)
        share = np.array([r.message_bytes for r in self.comm_rows], dtype=float) / self.gradient_bytes
        seconds = np.array([r.seconds for r in self.comm_rows], dtype=float)
        return world, share, seconds, float(np.sqrt(max(step_rows, 1) / world.size))

    def _held_out_errors(self, shape: Shape, data: _Data) -> np.ndarray:
        groups = np.unique(data.group)
        folds = np.arange(groups.size) % MAX_LOO_FOLDS if groups.size > MAX_LOO_FOLDS else np.arange(groups.size)
        rng = np.random.default_rng(0)
        folds = folds[rng.permutation(groups.size)] if groups.size > MAX_LOO_FOLDS else folds
        fold_of_row = folds[np.searchsorted(groups, data.group)]
        errors = np.empty(data.step_s.size)
        for fold in np.unique(fold_of_row):
            held = fold_of_row == fold
            theta, _ = self._fit_shape(shape, data.take(~held))
            test = data.take(held)
            predicted = self._predict_vector(theta, shape, test.g, test.m, test.n, self.compute_.predict(test.batch))
            errors[held] = np.abs(predicted / test.step_s - 1.0)
        return errors

    def fit(self, rows) -> PlacementStepModel:
        rows = validate_rows(rows)
        single = [r for r in rows if sum(r.placement) == 1]
        if not single:
            raise ValueError("need at least one single-GPU row (placement '1') to fit the compute model T_c(b)")
        self.compute_, self.compute_selection_ = select_compute_model(
            [r.device_batch for r in single], [r.step_time_s for r in single]
        )
        multi = _Data.of([r for r in rows if sum(r.placement) > 1])
        one_batch = np.unique(multi.batch).size < 2
        equations = multi.step_s.size + int(np.isfinite(multi.compute_part_s).sum())
        placements = np.unique(multi.group).size
        self.candidates_ = {}
        for shape in self.shapes:
            # each training fold leaves a placement out; it must still hold more equations than parameters
            eligible = placements >= 3 and int(shape.free().sum()) < equations * (placements - 1) / placements
            eligible = eligible and not (one_batch and shape.overlap)  # gamma is not identifiable from one batch
            entry = {"free_params": int(shape.free().sum()), "eligible": bool(eligible), "held_out": None}
            if eligible:
                errors = self._held_out_errors(shape, multi)
                entry["held_out"] = {"median_rel_err": float(np.median(errors)), "p90_rel_err": float(np.quantile(errors, 0.9)), "rows": int(errors.size)}
            self.candidates_[shape.name] = entry
        scored = [s for s in self.shapes if self.candidates_[s.name]["eligible"]]
        if not scored:
            # the hierarchical ring over the given links: the analytic model's (step_time.AnalyticStepTime)
            self.shape_, self.theta_, self.fit_log_rmse_ = Shape("hierarchical", False, False, False), self._assumed_vector(), None
            self.why_ = (f"{multi.step_s.size} multi-device rows on {placements} placements cannot fit a link: "
                         f"the given links, gamma = {ASSUMED_GAMMA:g} and kappa = 0 are assumed")  # fmt: skip
            self.sources_ = dict.fromkeys(("intra", "inter", "kappa"), "assumed") | {"gamma": self._assumed_gamma_source("too few multi-device rows to fit it")}
            return self
        scored.sort(key=lambda s: (self.candidates_[s.name]["held_out"]["median_rel_err"], int(s.free().sum())))
        best = scored[0]
        for shape in sorted(scored, key=lambda s: int(s.free().sum())):  # simplest shape within the tie tolerance
            if self.candidates_[shape.name]["held_out"]["median_rel_err"] <= self.candidates_[best.name]["held_out"]["median_rel_err"] + TIE_TOLERANCE:
                best = shape
                break
        self.shape_ = best
        self.theta_, self.fit_log_rmse_ = self._fit_shape(best, multi)
        err = self.candidates_[best.name]["held_out"]["median_rel_err"]
        self.why_ = f"{best.name} has the lowest median held-out relative error ({err:.1%}, leave-placements-out), simplest on ties"
        has_inter = bool(np.any(multi.m > 1))
        has_intra = bool(np.any(multi.g > 1)) or self._comm_arrays(multi.step_s.size) is not None
        self.sources_ = {
            "intra": "fitted" if has_intra else "assumed",
            "inter": "fitted" if has_inter else "assumed",
            "gamma": "fitted" if best.overlap else self._assumed_gamma_source(
                "every multi-device row is at one per-GPU batch, where the overlap cannot be told from the links" if one_batch
                else "the shape with gamma assumed predicted the held-out placements best"),
            "kappa": "fitted" if best.contention else "assumed (0: no contention)",
        }
        if not has_inter:  # nothing measured the inter link: keep the given one
            self.theta_[2:4] = self._assumed_vector()[2:4]
        return self

    @staticmethod
    def _assumed_gamma_source(why: str) -> str:
        return f"assumed ({ASSUMED_GAMMA:g}, halfway in 1/gamma between no overlap and perfect overlap: {why})"

    def predict(self, g, m, n, device_batch) -> np.ndarray:
        """Seconds per step, broadcast over (g, m, n) placement features and the per-GPU batch."""
        g, m, n, batch = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (g, m, n, device_batch)))
        step_s = self._predict_vector(self.theta_, self.shape_, g, m, n, self.compute_.predict(batch))
        return np.where(n > 1, step_s, self.compute_.predict(batch))

    def micro_step_s(self, g, device_batch) -> np.ndarray:
        """Seconds of one accumulation micro-step (no all-reduce) with g GPUs on the busiest node:
        (1 + kappa (g - 1)) T_c(b), the straggler falling behind on every micro-step (module docstring)."""
        return (1.0 + float(self.theta_[5]) * (np.asarray(g, dtype=float) - 1.0)) * self.compute_.predict(device_batch)

    def predict_placements(self, placements, device_batch) -> np.ndarray:
        g, m, n = placement_features(placements)
        return self.predict(g, m, n, device_batch)

    def allreduce_s(self, placements) -> np.ndarray:
        g, m, n = placement_features(placements)
        return _allreduce_s(self.shape_.topology, g, m, n, *self.theta_[:4])

    def params_(self) -> dict[str, Any]:
        lat_a, xfer_a, lat_e, xfer_e, gamma, kappa = (float(v) for v in self.theta_)
        gbps = (lambda xfer: self.gradient_bytes * 8.0 / xfer / 1e9) if self.gradient_bytes else (lambda xfer: None)
        latency_source = lambda link: self.sources_[link] if self.shape_.fit_latency else "assumed"  # noqa: E731
        return {
            "intra": {"latency_s": lat_a, "transfer_s": xfer_a, "bandwidth_gbps": gbps(xfer_a),
                      "source": self.sources_["intra"], "latency_source": latency_source("intra")},
            "inter": {"latency_s": lat_e, "transfer_s": xfer_e, "bandwidth_gbps": gbps(xfer_e),
                      "source": self.sources_["inter"], "latency_source": latency_source("inter")},
            "gamma": {"value": gamma, "source": self.sources_["gamma"]},
            "kappa": {"value": kappa, "source": self.sources_["kappa"]},
        }  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {"chosen": self.shape_.name, "why": self.why_, "params": self.params_(), "fit_log_rmse": self.fit_log_rmse_,
                "compute": self.compute_selection_["chosen"], "candidates": self.candidates_,
                "benchmark_points": len(self.comm_rows) if self._comm_arrays(1) is not None else 0}  # fmt: skip

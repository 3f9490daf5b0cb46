"""The gradient noise scale for a job's target, read from gradient statistics taken along a training run.

The noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) grows 10-1000x as the loss falls, so
one value read at initialization under-predicts the useful batch. The epochs model E(B) = E_min (1 + B /
B_noise) needs one B_noise for the whole run to the target; this module reads it from the trajectory of a
run at batch b (the user's reference run, or the pilot point). T = E_ref x D is the reference run's samples
to the target; records past T (a run logged beyond the target) are not used, but for one that brackets the window's
middle when the records before T stop short of it (item 4).

1. Read (the default, WINDOW and WINDOW_AVERAGE = "progress"): the progress-weighted mean of the noise
   scale over the records between WINDOW[0] T and WINDOW[1] T, the second half of the run to the target.
   Why that mean (McCandlish et al. 2018, sec. 2.2, and App. D on a noise scale that varies): a step at
   batch B with the best LR makes the progress of 1 / (1 + B_noise / B) noise-free steps, so at a fixed B
   the steps are S(B) = int (1 + B_noise / B) dS_min = S_min + (1 / B) int B_noise dS_min and the epochs
   E(B) = B S(B) / D = E_min (1 + B / B_eff), with

       B_eff = int B_noise dS_min / int dS_min        (E_min = int B_noise dS_min / D):

   the noise scale averaged over the progress dS_min, not over steps or samples. A record i of the run at
   batch b stands for n_i samples, n_i / b steps that made the progress dS_min,i = (n_i / b) r_i, where
   r_i = 1 / (1 + B_i / b) = |G_i|^2 / (|G_i|^2 + tr_i / b) is the share of the step's E|g_b|^2 that is
   signal. Since B_i dS_min,i = n_i (1 - r_i),

       B_eff = sum_i n_i (1 - r_i) / sum_i (n_i / b) r_i                (progress_weighted_ratio).

   r_i is taken per record, as the integral wants it per step; its denominator |G|^2 + tr/b = |g_b|^2 is
   the measured squared norm of the step's gradient (positive, and measured far better than |G|^2), so a
   record whose |G|^2 estimate is near zero or negative moves the sum by its share, linearly, and never
   blows it up (pooling the records first would weigh them by |g_b|^2). n_i: the trapezoidal rule over the
   records, the first and last held out to the window's edges (window_spans). The theory integrates over
   the whole run; measured, that misses by far more (the first half of the run, where the noise scale is
   small, carries most of S_min, and the runs at large batches did not pay for it as predicted), so which
   part of the run to read is the measured choice below, and the mean over it is the theory's.
   Measured over 11 tasks (benchmarks/statistical_efficiency.py, docs/validation.md, 2026-12-02; medians
   over tasks of the median |epochs error|, worst task in brackets): the first record (what initialization
   gives) 35% (322%), the whole run pooled 44%, the second half pooled 28% (79%), the geometric mean of 8
   pooled bins of it 13% (67%), their median 14% (70%), the progress-weighted mean 18% (64%, the smallest
   worst task); that mean over the whole run 31% (113%), over 25-100% 16% (81%).
   Finite data: batches drawn without replacement from D samples have E|g_b|^2 = |G|^2 + s^2 (1/b - 1/D)
   (s^2 the per-sample variance), so the two-batch estimates tend to s^2 and |G|^2 - s^2 / D, and their
   ratio is s^2 / (|G|^2 - s^2 / D) = B' / (1 - B' / D), B' = s^2 / |G|^2: exactly the B_eff of E(B) when
   a step's noise is s^2 (1/B - 1/D). The correction is in the measurement; applying it again (x D / (D -
   1 - B)) counts it twice.
2. Extrapolation, when the records do not reach the window's middle (a pilot, a truncated log): the
   records are grouped into at most MAX_BINS contiguous bins (each pooled: numerator and denominator
   averaged separately, weighted by window steps, then divided; a bin whose pooled |G|^2 or tr(Sigma) is
   not positive is unresolved and dropped), log B_bin = a + c log(samples_bin) is fitted by least squares
   on the later half of the bins, and read at the window's middle with the slope held to [0, MAX_TREND_SLOPE]:
   early in training the noise scale can first fall (a transient of the initialization) before it grows,
   and McCandlish et al. find it grows as the loss falls, so a falling early trend is not extended. Nor is
   it extended faster than the samples seen: B_noise ~ tr(Sigma) / |G|^2 with |G|^2 ~ 2 lambda (L - L*)
   near a minimum, and after n fresh samples no estimator gets the excess loss below order
   tr(H^-1 Sigma) / n (the asymptotic limit of stochastic approximation, Polyak & Juditsky 1992), so |G|^2
   falls no faster than 1 / n and B_noise grows no faster than n: slope 1 in log-log. Over several epochs
   of a finite data set that is an assumption, not a theorem. The steeper slopes fitted on the benchmark's
   trajectories came from single bins: a spike mid-run made a pilot's 10% of a MNIST-1D run fit slope 5.3
   and read 93 000 where the whole run reads 230 (benchmarks/online.py), and the last bin of digits_mlp's
   reference run (71 after 13-48) fitted slope 2.7. The result is labelled extrapolated, with the fraction
   of the run covered and the slope used.
   Records far apart (a trace with a row per evaluation, a log written every few hundred steps): the window then
   holds fewer than two records and the read is the trend too. Paired bins need six records (PAIRED_BINS_FROM
   bins of MIN_RECORDS_PER_BIN); with fewer each record is its own bin, and two resolved bins make a trend
   (MIN_TREND_BINS), read where the window's middle is (interpolated inside the records, extrapolated past them
   as above). What it replaced, the pooled ratio of all the records, weighs them by |G|^2, so by the first ones:
   the Pollux CIFAR-10 trace at 90% of its best accuracy, thinned to every fourth row (3 rows before the target),
   read 104 where the whole trace reads 642 (122% epochs error; 19% now). Over the Pollux applications at six
   targets thinned to every 4th-32nd row, the worst median |epochs error| went 122-242% -> 21-193% and the median
   at every 32nd 56% -> 10% (benchmarks/statistical_efficiency.py, sparse_records); a single record before the
   target stays the pooled read of it, its growth unknown. The interval of a trend through two bins is their
   spread (no resampling varies it), widened past the records as below.
3. Interval: a seeded bootstrap (records of the window resampled with replacement, each with its n_i;
   bins for a trend), the INTERVAL_QUANTILES of the estimate: the statistical uncertainty, not the model's
   error.
4. Records past the target, when the records before T stop short of the window's middle (a trace with a row every
   few epochs, an early target): the first record past T joins the records for the trend, so that the middle lies
   between records and the trend is interpolated there, not extended past the last record before T (a log usually
   goes on past the target; records further on are left out, as the noise scale past the target is not the run's to
   it). Where records before T reach the middle, or there are none, nothing past T is used. Measured on the Pollux
   applications at six targets, thinned to every 16th and 32nd row (one or two rows before the target;
   benchmarks/statistical_efficiency.py, sparse_records, 2026-12-07): the worst median |epochs error| went 150% ->
   22% and 193% -> 22%, the median 6.0% -> 5.8% and 10.2% -> 7.3%; the CIFAR-10 run at 90% of its best accuracy,
   every 16th row, 75-151% -> 8-17%. The CPU tasks' runs stop at their target (some with a last record just past
   it): their headline is unchanged, and thinned to every 16th record their median went 23.0% -> 23.5%.
   records_past_target_ says whether one was used.
With window=None the power-law trend over all bins is read at run_fraction T instead; window_average
"geometric", "median" or "pooled" read the window as before (alternatives the benchmark compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

MAX_BINS = 16
MAX_TREND_SLOPE = 1.0  # B_noise grows no faster than the samples seen (module docstring, item 2)
MIN_RECORDS_PER_BIN = 2
MIN_TREND_BINS = 2  # a power-law trend through two resolved bins, its slope held to [0, MAX_TREND_SLOPE] (item 2)
PAIRED_BINS_FROM = 3  # records are paired into bins only where that leaves at least 3 bins; fewer records: one a bin
MIN_BOOTSTRAP_BINS = 3  # a trend's interval resamples its bins; through fewer, no resampling varies it
FEW_RECORDS = PAIRED_BINS_FROM * MIN_RECORDS_PER_BIN  # fewer records than this are a bin each (bins_of)
RUN_FRACTION = 0.5
WINDOW = (0.5, 1.0)
WINDOW_AVERAGE = "progress"
WINDOW_BINS = 8
INTERVAL_QUANTILES = (0.1, 0.9)
# a noise scale past this many samples means |G|^2 is nil beside tr(Sigma) at any batch that can run (the largest
# batch a spec allows is 2^24, the largest data set 10^12): the signal is not resolved, as for |G|^2 <= 0
MAX_RESOLVED_NOISE_SCALE = 1e15
BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Bin:
    samples: float  # geometric mean of the records' samples seen
    noise_scale: float


def _field(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def statistics_position(record: Any) -> float:
    """The samples seen where a record's statistics were taken: statistics_samples where the logger says it (sparse
    sampling takes them on a window's first steps), else the record's samples."""
    position = _field(record, "statistics_samples")
    return float(position if position is not None else _field(record, "samples"))


def record_arrays(records: Sequence[Any], statistic: str = "raw") -> dict[str, np.ndarray]:
    """samples (where each record's statistics were taken: statistics_position), weights (window steps), |G|^2,
    tr(Sigma) and batch of the records, sorted by samples seen. statistic "preconditioned" reads the Adam-preconditioned
    pair (records without it are skipped)."""
    keys = ("grad_sqr", "trace_sigma") if statistic == "raw" else ("precond_grad_sqr", "precond_trace_sigma")
    rows = [
        (statistics_position(r), float(_field(r, "window_steps") or 1), float(_field(r, keys[0])), float(_field(r, keys[1])),
         float(_field(r, "batch") or np.nan))
        for r in records
        if _field(r, keys[0]) is not None and _field(r, keys[1]) is not None
    ]  # fmt: skip
    rows.sort(key=lambda row: row[0])
    columns = (np.array(column, dtype=float) for column in zip(*rows)) if rows else (np.array([]),) * 5
    return dict(zip(("samples", "weights", "grad_sqr", "trace_sigma", "batch"), columns))


def window_spans(samples: np.ndarray, low: float, high: float) -> np.ndarray:
    """The samples of [low, high] each record stands for: the trapezoidal rule over the records' range (each
    record gets half the gap to either neighbour), the first and the last record's value held out to the
    window's edges. Sorted samples inside [low, high]."""
    edges = np.concatenate([[low], (samples[1:] + samples[:-1]) / 2, [high]])
    return np.diff(edges)


def progress_weighted_ratio(arrays: dict[str, np.ndarray]) -> float | None:
    """The noise scale the epochs model sees when it varies over the window (see the module docstring, 1.):

        r_i = |G_i|^2 / (|G_i|^2 + tr_i / b_i),   B_eff = sum_i n_i (1 - r_i) / sum_i (n_i / b_i) r_i,

    n_i the window's samples record i stands for (arrays["span"], else its window steps x b_i), b_i its batch.
    None when the pooled signal or noise is not positive (not resolved)."""
    batch, grad_sqr, trace_sigma = arrays["batch"], arrays["grad_sqr"], arrays["trace_sigma"]
    span = arrays["span"] if "span" in arrays else arrays["weights"] * batch
    squared_norm = grad_sqr + trace_sigma / batch  # E|g_b|^2 at the run's batch: > 0 for two-batch estimates
    ok = np.isfinite(squared_norm) & (squared_norm > 0) & (span > 0)
    if not ok.any():
        return None
    signal = grad_sqr[ok] / squared_norm[ok]
    progress, noise = float(np.sum(span[ok] / batch[ok] * signal)), float(np.sum(span[ok] * (1.0 - signal)))
    return _resolved(noise / progress) if progress > 0 and noise > 0 else None


def pooled_ratio(weights: np.ndarray, grad_sqr: np.ndarray, trace_sigma: np.ndarray) -> float | None:
    """sum(w tr Sigma) / sum(w |G|^2), or None when either pooled estimate is not positive (or the ratio is past
    MAX_RESOLVED_NOISE_SCALE)."""
    g, s = float(weights @ grad_sqr), float(weights @ trace_sigma)
    return _resolved(s / g) if g > 0 and s > 0 else None


def _resolved(noise_scale: float) -> float | None:
    """The ratio as a noise scale, or None where it is past MAX_RESOLVED_NOISE_SCALE (no signal resolved)."""
    return noise_scale if noise_scale <= MAX_RESOLVED_NOISE_SCALE else None


def bins_of(arrays: dict[str, np.ndarray]) -> tuple[list[Bin], int]:
    """Contiguous bins of records (see the module docstring) and how many bins were unresolved."""
    count = arrays["samples"].size
    paired = count >= FEW_RECORDS
    n_bins = max(1, min(MAX_BINS, count // MIN_RECORDS_PER_BIN if paired else count))
    bins, unresolved = [], 0
    for index in np.array_split(np.arange(count), n_bins):
        ratio = pooled_ratio(arrays["weights"][index], arrays["grad_sqr"][index], arrays["trace_sigma"][index])
        if ratio is None:
            unresolved += 1
            continue
        position = float(np.exp(np.mean(np.log(np.maximum(arrays["samples"][index], 1.0)))))
        bins.append(Bin(position, ratio))
    return bins, unresolved


def window_value(arrays: dict[str, np.ndarray], average: str) -> float | None:
    """One B_noise for the records of a window: "progress", the progress-weighted mean of the theory
    (progress_weighted_ratio); "pooled", sum(w tr Sigma) / sum(w |G|^2) over all of them (which weighs the
    records by |G|^2, so by the start of the window when |G|^2 falls fast); or the "median" or "geometric"
    mean of up to WINDOW_BINS contiguous pooled bins, each part of the window weighing the same."""
    if average == "progress":
        return progress_weighted_ratio(arrays)
    if average == "pooled":
        return pooled_ratio(arrays["weights"], arrays["grad_sqr"], arrays["trace_sigma"])
    count = arrays["samples"].size
    ratios = [pooled_ratio(arrays["weights"][i], arrays["grad_sqr"][i], arrays["trace_sigma"][i])
              for i in np.array_split(np.arange(count), max(1, min(WINDOW_BINS, count)))]  # fmt: skip
    ratios = [r for r in ratios if r is not None]
    if not ratios:
        return None
    return float(np.median(ratios)) if average == "median" else float(np.exp(np.mean(np.log(ratios))))


def _trend(bins: list[Bin]) -> tuple[float, float]:
    """(a, c) of log B = a + c log(samples)."""
    x = np.log([b.samples for b in bins])
    y = np.log([b.noise_scale for b in bins])
    if np.ptp(x) == 0:
        return float(np.mean(y)), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def read_trend(bins: list[Bin], at_samples: float) -> tuple[float, float, bool]:
    """(B_noise at `at_samples`, the slope used, extrapolated?) from the bins' power-law trend."""
    covered = bins[-1].samples
    if at_samples <= covered:
        intercept, slope = _trend(bins)
        return float(np.exp(intercept + slope * np.log(at_samples))), slope, False
    later = bins[len(bins) // 2 :] if len(bins) >= 6 else bins
    intercept, fitted_slope = _trend(later)
    start = np.log(covered)
    level = intercept + fitted_slope * start  # the later trend's value at the last bin
    slope = min(max(fitted_slope, 0.0), MAX_TREND_SLOPE)
    return float(np.exp(level + slope * (np.log(at_samples) - start))), slope, True


class TrajectoryNoiseScale:
    """B_noise for the target from a run's gradient-statistics records (see the module docstring).

    window=(lo, hi): read the records between lo T and hi T by window_average (default: their progress-weighted
    mean) when they reach the window's middle, else extrapolate the trend to the middle; window=None: read the
    trend at run_fraction T."""

    def __init__(
        self, run_fraction: float = RUN_FRACTION, statistic: str = "raw", window: tuple[float, float] | None = WINDOW,
        window_average: str = WINDOW_AVERAGE,
    ):  # fmt: skip
        self.run_fraction = (window[0] + window[1]) / 2 if window else run_fraction
        self.window = window
        self.window_average = window_average
        self.statistic = statistic

    def fit(self, records: Sequence[Any], target_samples: float, interval: bool = True) -> "TrajectoryNoiseScale":
        """interval=False skips the bootstrap (interval_ None): for a read that is one step of a search."""
        return self.fit_arrays(record_arrays(records, self.statistic), target_samples, interval)

    def fit_arrays(self, arrays: dict[str, np.ndarray], target_samples: float, interval: bool = True) -> "TrajectoryNoiseScale":
        """fit on the records already as record_arrays(records, self.statistic): a search that reads the same
        records at many targets converts them once."""
        within = arrays["samples"] <= target_samples
        past = np.flatnonzero(~within)
        everything, arrays = arrays, {key: value[within] for key, value in arrays.items()}
        self.records_ = int(arrays["samples"].size)
        self.target_samples_ = float(target_samples)
        self.at_samples_ = self.run_fraction * target_samples
        self.records_past_target_ = 0
        self.covered_samples_ = float(arrays["samples"].max()) if self.records_ else 0.0
        if past.size and self.window is not None and 0 < self.covered_samples_ < self.at_samples_:  # bracket the window's middle (item 4)
            nearest = past[np.argmin(everything["samples"][past])]
            arrays = {key: np.append(value, everything[key][nearest]) for key, value in arrays.items()}
            self.records_past_target_ = 1
            self.covered_samples_ = float(everything["samples"][nearest])
        self.coverage_ = min(1.0, self.covered_samples_ / target_samples) if target_samples > 0 else 0.0
        bins, self.unresolved_bins_ = bins_of(arrays) if arrays["samples"].size else ([], 0)
        self.bins_ = bins
        self.noise_scale_, self.slope_, self.extrapolated_, self.method_ = self._estimate(bins, arrays)
        self.interval_ = self._interval(bins, arrays) if interval and self.noise_scale_ is not None else None
        return self

    def _window(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The records inside the window, when they reach its middle (else None: extrapolate)."""
        if self.window is None or self.covered_samples_ < self.at_samples_:
            return None
        low, high = (fraction * self.target_samples_ for fraction in self.window)
        inside = (arrays["samples"] >= low) & (arrays["samples"] <= high)
        if inside.sum() < MIN_RECORDS_PER_BIN:
            return None
        window = {key: value[inside] for key, value in arrays.items()}
        return window | {"span": window_spans(window["samples"], low, high)}

    def _estimate(self, bins: list[Bin], arrays: dict[str, np.ndarray]) -> tuple[float | None, float | None, bool, str]:
        window = self._window(arrays)
        if window is not None:
            low, high = self.window
            how = {"progress": "progress-weighted mean", "geometric": "geometric mean of the pooled bins",
                   "median": "median of the pooled bins"}.get(self.window_average, "pooled ratio")  # fmt: skip
            return window_value(window, self.window_average), None, False, f"{how} of the records between {low:.0%} and {high:.0%} of the run to the target"
        if len(bins) >= MIN_TREND_BINS:
            value, slope, extrapolated = read_trend(bins, self.at_samples_)
            return value, slope, extrapolated, "power-law trend of the binned noise scale"
        ratio = pooled_ratio(arrays["weights"], arrays["grad_sqr"], arrays["trace_sigma"]) if self.records_ else None
        extrapolated = self.covered_samples_ < self.at_samples_
        return ratio, (0.0 if ratio else None), extrapolated, "pooled ratio of all records (too few resolved bins for a trend)"

    def _interval(self, bins: list[Bin], arrays: dict[str, np.ndarray]) -> tuple[float, float] | None:
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        window = self._window(arrays)
        if window is not None:  # resample the window's records
            arrays, bins = window, []
        elif MIN_TREND_BINS <= len(bins) < MIN_BOOTSTRAP_BINS:  # a trend through two bins: their own spread
            values = [b.noise_scale for b in bins]
            return float(min(*values, self.noise_scale_)), float(max(*values, self.noise_scale_))
        records = arrays["samples"].size
        estimates = []
        for _ in range(BOOTSTRAP_RESAMPLES):
            if len(bins) >= MIN_BOOTSTRAP_BINS:
                chosen = sorted((bins[i] for i in rng.integers(0, len(bins), len(bins))), key=lambda b: b.samples)
                if len({b.samples for b in chosen}) < 2:
                    continue
                estimates.append(read_trend(chosen, self.at_samples_)[0])
            else:
                index = np.sort(rng.integers(0, records, records))
                value = window_value({key: column[index] for key, column in arrays.items()}, self.window_average if window is not None else "pooled")
                if value is not None:
                    estimates.append(value)
        if len(estimates) < BOOTSTRAP_RESAMPLES // 2:
            return None
        low, high = np.quantile(estimates, INTERVAL_QUANTILES)
        return float(min(low, self.noise_scale_)), float(max(high, self.noise_scale_))

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.method_,
            "statistic": self.statistic,
            "records": self.records_,
            "resolved_bins": len(self.bins_),
            "unresolved_bins": self.unresolved_bins_,
            "read_at_samples": self.at_samples_,
            "run_fraction": self.run_fraction,
            "window": list(self.window) if self.window else None,
            "target_samples": self.target_samples_,
            "coverage": self.coverage_,
            "extrapolated": self.extrapolated_,
            "slope": self.slope_,
            "interval": list(self.interval_) if self.interval_ else None,
            "interval_quantiles": list(INTERVAL_QUANTILES),
            # the trajectory it was read from, for a plot: the pooled noise scale of each bin of records up to the target
            # (and the first record past it, where it brackets the window's middle: records_past_target)
            # (bins_of: at most MAX_BINS, each at the geometric mean of its records' samples; unresolved bins left out)
            "bins": {"samples": [b.samples for b in self.bins_], "noise_scale": [b.noise_scale for b in self.bins_]},
            "covered_samples": self.covered_samples_,
            "records_past_target": self.records_past_target_,
        }

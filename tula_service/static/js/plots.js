// Plotly figures of a recommendation (the API's JSON): pure functions from data to {data, layout}.
// plotly.js is the copy shipped in the `plotly` Python package, loaded as the global `Plotly`.
// The model curves are the server's (recommendation.curves, evaluated by the planner's own models):
// nothing here evaluates a formula. A recommendation stored before it carried curves draws the
// measurements alone.

import { formatDuration, formatPercent, formatUsd, significant } from "./format.js";

const GIB = 2 ** 30;
const SYMBOLS = ["circle", "square", "diamond", "triangle-up", "cross", "x", "star-triangle-up", "pentagon", "hexagon", "star"];
const COLORS = { measured: "#1f77b4", fitted: "#ff7f0e", limit: "#d62728", spec: "#2ca02c", note: "#555" };
// Log axes labelled with plain numbers (not plotly's bare leading digits between decades).
const LOG_AXIS = { type: "log", gridcolor: "#e5e5e5", zeroline: false, tickformat: "~g" };
// Ticks that keep their labels apart on a phone: every digit over a short range, 1-2-5 over up
// to two decades, one per decade beyond.
function logTicks(low, high) {
  const span = Math.log10(high / low);
  if (span > 2) return { dtick: 1 };
  return span > 0.6 ? { dtick: "D2" } : {};
}
const PHONE = window.matchMedia("(max-width: 600px)");
const CONFIG = {
  responsive: true, displaylogo: false, modeBarButtonsToRemove: ["select2d", "lasso2d"],
  displayModeBar: PHONE.matches ? false : "hover", // on a phone it would cover the legend
};

function baseLayout(xTitle, yTitle, extra = {}) {
  return {
    autosize: true,
    margin: { l: 64, r: 16, t: 12, b: 48 },
    paper_bgcolor: "rgba(0,0,0,0)",
    plot_bgcolor: "rgba(0,0,0,0)",
    font: { size: 12 },
    hovermode: "closest",
    legend: { orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom" }, // above: margins grow to fit it
    xaxis: { ...LOG_AXIS, title: { text: xTitle } },
    yaxis: { title: { text: yTitle }, gridcolor: "#e5e5e5", zeroline: false },
    ...extra,
  };
}

function powersOfTwoTicks(values) {
  const sorted = [...new Set(values)].sort((a, b) => a - b);
  return { tickvals: sorted, ticktext: sorted.map(String) };
}

function line(name, x, y, style = {}) {
  return { type: "scatter", mode: "lines", name, x, y, hoverinfo: "skip", ...style };
}

export function draw(div, figure) {
  return Plotly.react(div, figure.data, figure.layout, CONFIG);
}

// The index of the knee candidate, as the API names it (null without a knee, or in a plan stored before it did).
export function kneeIndex(rec) {
  return rec.knee?.candidate ?? null;
}

// The unit of the time axis: hours, minutes or seconds, whichever suits the median candidate.
export function timeUnit(seconds) {
  const median = [...seconds].sort((a, b) => a - b)[Math.floor(seconds.length / 2)];
  if (median >= 2 * 3600) return { name: "h", seconds: 3600 };
  if (median >= 120) return { name: "min", seconds: 60 };
  return { name: "s", seconds: 1 };
}

export function paretoFigure(rec) {
  const rows = rec.candidates;
  const unit = timeUnit(rows.map((row) => row.total_time_s.value));
  const time = (row) => row.total_time_s.value / unit.seconds;
  const usd = (row) => row.cost_usd.value;
  const deviceCounts = [...new Set(rows.map((row) => row.devices))].sort((a, b) => a - b);
  const symbolOf = (devices) => SYMBOLS[deviceCounts.indexOf(devices) % SYMBOLS.length];
  const batches = [...new Set(rows.map((row) => row.global_batch))].sort((a, b) => a - b);
  const hover = (row) => [row.global_batch, row.device_batch, row.devices, row.accumulation,
    formatDuration(row.total_time_s.value), formatUsd(usd(row))];
  const hovertemplate = "global batch %{customdata[0]} = %{customdata[1]} per device × %{customdata[2]} devices"
    + " × %{customdata[3]} accumulation<br>time %{customdata[4]} · cost %{customdata[5]} (predicted)<extra>%{fullData.name}</extra>";
  const marked = (name, row, marker) => ({
    type: "scatter", mode: "markers", name, x: [time(row)], y: [usd(row)], customdata: [hover(row)], hovertemplate, marker,
  });

  const data = [{
    type: "scatter",
    mode: "markers",
    name: "candidates",
    x: rows.map(time),
    y: rows.map(usd),
    customdata: rows.map(hover),
    hovertemplate,
    showlegend: false,
    marker: {
      size: 9,
      symbol: rows.map((row) => symbolOf(row.devices)),
      color: rows.map((row) => Math.log2(row.global_batch)),
      colorscale: "Viridis",
      line: { width: 0.5, color: "#fff" },
      colorbar: {
        title: { text: "global<br>batch" }, thickness: 12, len: 0.9,
        tickvals: batches.map(Math.log2), ticktext: batches.map(String),
      },
    },
  }];
  for (const devices of deviceCounts) { // legend entries for the symbols (no points of their own)
    data.push({
      type: "scatter", mode: "markers", name: `${devices} device${devices === 1 ? "" : "s"}`, x: [null], y: [null],
      marker: { symbol: symbolOf(devices), size: 9, color: "#777" }, hoverinfo: "skip", legendgroup: "devices",
    });
  }
  const front = [...rec.pareto_front].sort((a, b) => time(rows[a]) - time(rows[b]));
  data.push(line("Pareto front", front.map((i) => time(rows[i])), front.map((i) => usd(rows[i])),
    { line: { color: COLORS.limit, width: 2 }, mode: front.length > 1 ? "lines" : "markers" }));
  const knee = kneeIndex(rec);
  if (knee !== null) {
    data.push(marked(`knee (${rec.knee.method})`, rows[knee],
      { symbol: "circle-open", size: 22, color: "#000", line: { width: 3, color: "#000" } }));
  }
  data.push(marked(`chosen (${rec.objective})`, rec.chosen,
    { symbol: "star", size: 17, color: COLORS.limit, line: { width: 1, color: "#fff" } }));

  const shapes = [];
  if (rec.constraint) {
    const vertical = rec.constraint.kind === "deadline";
    shapes.push({
      type: "line", xref: vertical ? "x" : "paper", yref: vertical ? "paper" : "y",
      x0: vertical ? (rec.constraint.limit * 3600) / unit.seconds : 0, x1: vertical ? (rec.constraint.limit * 3600) / unit.seconds : 1,
      y0: vertical ? 0 : rec.constraint.limit, y1: vertical ? 1 : rec.constraint.limit,
      line: { color: COLORS.limit, dash: "dot", width: 2 },
    });
  }
  return {
    data,
    layout: baseLayout(`total training time (${unit.name}, predicted)`, "cost (USD, predicted)", {
      xaxis: { ...LOG_AXIS, ...logTicks(Math.min(...rows.map(time)), Math.max(...rows.map(time))),
        title: { text: `total training time (${unit.name}, predicted)` } },
      yaxis: { ...LOG_AXIS, ...logTicks(Math.min(...rows.map(usd)), Math.max(...rows.map(usd))),
        title: { text: "cost (USD, predicted)" } },
      shapes,
      meta: { time_unit_s: unit.seconds },
    }),
  };
}

// The x range of a curve: its first and last batch, or the measured batches' without a curve.
function batchRange(rec, curve) {
  if (curve) return [curve.device_batch[0], curve.device_batch.at(-1)];
  const batches = rec.profiled.points.map((p) => p.batch_size);
  return [Math.min(...batches), Math.max(...batches)];
}

export function iterTimeFigure(rec) {
  const points = rec.profiled.points;
  const curve = rec.curves?.iter_time;
  const data = [{
    type: "scatter", mode: "markers", name: "measured (median, p10–p90)",
    x: points.map((p) => p.batch_size),
    y: points.map((p) => p.iter_time_median_s),
    error_y: {
      type: "data", symmetric: false,
      array: points.map((p) => (p.iter_time_p90_s ?? p.iter_time_median_s) - p.iter_time_median_s),
      arrayminus: points.map((p) => p.iter_time_median_s - (p.iter_time_p10_s ?? p.iter_time_median_s)),
    },
    customdata: points.map((p) => [formatDuration(p.iter_time_median_s), p.samples, significant(100 * (p.iter_time_cv || 0), 2),
      significant(100 * (p.iter_time_robust_cv ?? p.iter_time_cv ?? 0), 2),
      p.host_contended ? "<br>the host was busy while it was measured" : ""]),
    hovertemplate: "batch %{x}: %{customdata[0]} median (measured)<br>%{customdata[1]} samples, CV %{customdata[2]}% "
      + "(robust %{customdata[3]}%)%{customdata[4]}<extra></extra>",
    marker: { color: COLORS.measured, size: 9 },
  }];
  if (curve) {
    data.push(line(`fitted: ${curve.model} (LOO ±${formatPercent(curve.rel_err)})`, curve.device_batch, curve.iter_time_s,
      { line: { color: COLORS.fitted, width: 2 } }));
  }
  const layout = baseLayout("per-device batch", "iteration time (s)");
  Object.assign(layout.xaxis, powersOfTwoTicks(points.map((p) => p.batch_size)));
  return { data, layout };
}

export function throughputFigure(rec) {
  const points = rec.profiled.points;
  const unit = rec.batch_unit?.unit || "samples";
  const curve = rec.curves?.iter_time;
  const rate = (p, seconds) => p.batch_size / seconds;
  const data = [{
    type: "scatter", mode: "markers", name: "measured (from p90, median, p10 time)",
    x: points.map((p) => p.batch_size),
    y: points.map((p) => rate(p, p.iter_time_median_s)),
    error_y: {
      type: "data", symmetric: false,
      array: points.map((p) => rate(p, p.iter_time_p10_s ?? p.iter_time_median_s) - rate(p, p.iter_time_median_s)),
      arrayminus: points.map((p) => rate(p, p.iter_time_median_s) - rate(p, p.iter_time_p90_s ?? p.iter_time_median_s)),
    },
    hovertemplate: `batch %{x}: %{y:.4g} ${unit}/s (measured)<extra></extra>`,
    marker: { color: COLORS.measured, size: 9 },
  }];
  if (curve) {
    data.push(line(`fitted: batch / T_comp(${curve.model})`, curve.device_batch, curve.samples_per_s,
      { line: { color: COLORS.fitted, width: 2 } }));
  }
  const layout = baseLayout("per-device batch", `throughput (${unit}/s per device)`);
  Object.assign(layout.xaxis, powersOfTwoTicks(points.map((p) => p.batch_size)));
  return { data, layout };
}

export function memoryFigure(rec) {
  const points = rec.profiled.points;
  const capacityGib = rec.device.memory_gib.value;
  const margin = rec.search_space.memory_margin.value;
  const maxBatch = rec.search_space.max_device_batch.value;
  const curve = rec.curves?.memory;
  const [low, right] = batchRange(rec, curve);
  const data = [
    {
      type: "scatter", mode: "markers", name: "measured peak",
      x: points.map((p) => p.batch_size), y: points.map((p) => p.peak_bytes / GIB),
      hovertemplate: "batch %{x}: %{y:.4g} GiB peak (measured)<extra></extra>",
      marker: { color: COLORS.measured, size: 9 },
    },
  ];
  if (curve) {
    const toGib = (values) => values.map((bytes) => bytes / GIB);
    data.push(line(`fitted: M(b) = static + act × b (LOO ±${formatPercent(curve.rel_err)})`, curve.device_batch,
      toGib(curve.memory_bytes), { line: { color: COLORS.fitted, width: 2 } }));
    if (curve.memory_upper_bytes.some((bytes, i) => bytes > curve.memory_bytes[i])) { // zero width: the same line
      data.push(line("95% upper bound (what the max batch must fit)", curve.device_batch, toGib(curve.memory_upper_bytes),
        { line: { color: COLORS.fitted, width: 1, dash: "dash" } }));
    }
  }
  data.push(
    line(`device capacity ${significant(capacityGib)} GiB (${rec.device.memory_gib.source})`, [low, right],
      [capacityGib, capacityGib], { line: { color: COLORS.limit, width: 2 } }),
    line(`usable: ${significant(100 * (1 - margin))}% (margin assumed)`, [low, right],
      [capacityGib * (1 - margin), capacityGib * (1 - margin)], { line: { color: COLORS.limit, width: 1, dash: "dash" } }),
    {
      type: "scatter", mode: "lines", name: `max batch ${maxBatch} (predicted)`, x: [maxBatch, maxBatch],
      y: [Math.min(...points.map((p) => p.peak_bytes / GIB)) / 2, capacityGib * 1.5],
      line: { color: COLORS.note, width: 2, dash: "dot" }, hovertemplate: `max per-device batch ${maxBatch} (predicted)<extra></extra>`,
    },
  );
  if (rec.profiled.oom_batches.length) {
    data.push({
      type: "scatter", mode: "markers", name: "out of memory (measured)",
      x: rec.profiled.oom_batches, y: rec.profiled.oom_batches.map(() => capacityGib),
      marker: { symbol: "x", size: 12, color: COLORS.limit }, hovertemplate: "batch %{x}: out of memory (measured)<extra></extra>",
    });
  }
  const gib = [...points.map((p) => p.peak_bytes / GIB), capacityGib];
  const layout = baseLayout("per-device batch", "memory per device (GiB)", {
    xaxis: { ...LOG_AXIS, ...logTicks(low, right), title: { text: "per-device batch" } },
    yaxis: { ...LOG_AXIS, ...logTicks(Math.min(...gib), Math.max(...gib)), title: { text: "memory per device (GiB)" } },
  });
  return { data, layout };
}

export function efficiencyFigure(rec, spec) {
  const efficiency = rec.models.efficiency;
  const training = spec.training;
  const candidateBatches = [...new Set(rec.candidates.map((row) => row.global_batch))].sort((a, b) => a - b);
  const epochsAt = new Map(rec.candidates.map((row) => [row.global_batch, row.epochs]));
  const noise = efficiency.noise_scale;
  const curve = rec.curves?.epochs;
  const x = curve ? curve.global_batch : [...candidateBatches, training.reference_batch];
  const y = curve ? curve.epochs : [...candidateBatches.map((B) => epochsAt.get(B).value), training.reference_epochs];
  const [low, high] = [Math.min(...x), Math.max(...x)];
  const label = curve?.source === "assumed" ? "assumed: E(B) = E_ref max(1, B / B_ref)" : "fitted: E(B) = E_min (1 + B / B_noise)";
  const band = curve?.calibrated_low && curve?.calibrated_high // the 80% interval calibrated across tasks (epochs_calibration.py)
    ? [line("80% interval, calibrated across tasks: low", curve.global_batch, curve.calibrated_low,
      { line: { color: COLORS.fitted, width: 0 }, showlegend: false }),
    line("80% interval (the model's error measured across tasks)", curve.global_batch, curve.calibrated_high,
      { line: { color: COLORS.fitted, width: 0 }, fill: "tonexty", fillcolor: "rgba(31,119,180,0.15)" })]
    : [];
  const data = [
    ...band,
    ...(curve ? [line(label, curve.global_batch, curve.epochs, { line: { color: COLORS.fitted, width: 2 } })] : []),
    {
      type: "scatter", mode: "markers", name: `candidates' global batches (${epochsAt.get(candidateBatches[0]).source})`,
      x: candidateBatches, y: candidateBatches.map((B) => epochsAt.get(B).value),
      hovertemplate: "global batch %{x}: %{y:.4g} epochs (predicted)<extra></extra>", marker: { color: COLORS.fitted, size: 7 },
    },
    {
      type: "scatter", mode: "markers", name: "your reference run (spec)", x: [training.reference_batch], y: [training.reference_epochs],
      hovertemplate: "reference: batch %{x}, %{y} epochs (spec)<extra></extra>", marker: { color: COLORS.spec, size: 12, symbol: "diamond" },
    },
    {
      type: "scatter", mode: "markers", name: "chosen", x: [rec.chosen.global_batch], y: [rec.chosen.epochs.value],
      hovertemplate: "chosen: batch %{x}, %{y:.4g} epochs<extra></extra>", marker: { color: COLORS.limit, size: 14, symbol: "star" },
    },
  ];
  const top = Math.max(...y) * 1.05;
  const bottom = Math.min(...y) * 0.95;
  const shapes = [];
  const others = training.other_runs || [];
  if (others.length) {
    data.push({
      type: "scatter", mode: "markers", name: "your other runs (spec)", x: others.map((run) => run.batch), y: others.map((run) => run.epochs),
      hovertemplate: "run: batch %{x}, %{y} epochs (spec)<extra></extra>", marker: { color: COLORS.spec, size: 10, symbol: "diamond-open" },
    });
  }
  if (noise) {
    const [bandLow, bandHigh] = noise.interval || [noise.value, noise.value]; // the interval efficiency_evidence.py gives
    const range = bandHigh > bandLow ? ` [${significant(bandLow)}, ${significant(bandHigh)}]` : "";
    const from = noise.evidence ? `, from the ${noise.evidence.replace("_", " ")}` : "";
    data.push({
      type: "scatter", mode: "lines", name: `noise scale ${significant(noise.value)}${range} (fitted${from})`,
      x: [noise.value, noise.value], y: [bottom, top], line: { color: COLORS.note, width: 2, dash: "dot" },
      hovertemplate: `B_noise = ${significant(noise.value)}${range} (fitted${from})<extra></extra>`,
    });
    if (bandHigh > bandLow) {
      shapes.push({
        type: "rect", xref: "x", yref: "paper", x0: Math.max(bandLow, low), x1: bandHigh, y0: 0, y1: 1,
        fillcolor: "rgba(85,85,85,0.12)", line: { width: 0 },
      });
    }
  }
  const layout = baseLayout("global batch", "epochs to the target", { shapes });
  Object.assign(layout.xaxis, logTicks(low, high));
  return { data, layout };
}

// The noise scale along the run it was read from: the reference run's or the pilot's records, binned and pooled by
// the service (models.efficiency.evidence.candidates[].detail.bins, measured), the part of the run read (the window,
// as fractions of the run to the target), the value read (fitted: the window's progress-weighted mean, or the bins'
// trend extended when the records stop short of the window: dashed) and where the run reaches the target. null when
// no evidence came from a trajectory (the initial weights alone, or a plan stored before the bins were reported).
export function noiseTrajectoryFigure(rec, spec) {
  const efficiency = rec.models.efficiency;
  const read = (efficiency.evidence?.candidates || []).find((candidate) => candidate.detail?.bins?.samples?.length);
  if (!read) return null;
  const detail = read.detail;
  const perEpoch = spec.dataset.num_samples;
  const epochs = (samples) => samples / perEpoch;
  const from = read.source.replace("_", " ");
  const x = detail.bins.samples.map(epochs);
  const y = detail.bins.noise_scale;
  const target = epochs(detail.target_samples);
  const data = [{
    type: "scatter", mode: "lines+markers", x, y,
    name: `${from}: B_simple${detail.statistic === "preconditioned" ? " of the preconditioned gradient" : ""}, records pooled in ${x.length} bins (measured)`,
    hovertemplate: "epoch %{x:.3g}: B_simple %{y:.4g} (measured)<extra></extra>",
    line: { color: COLORS.measured, width: 1 }, marker: { color: COLORS.measured, size: 7 },
  }];
  const shapes = [];
  const span = detail.window; // fractions of the run to the target
  if (span) {
    shapes.push({
      type: "rect", xref: "x", yref: "paper", x0: span[0] * target, x1: span[1] * target, y0: 0, y1: 1,
      fillcolor: "rgba(255,127,14,0.10)", line: { width: 0 },
    });
  }
  const value = read.noise_scale;
  if (value) {
    const trend = (detail.method || "").startsWith("power-law trend");
    const bracketed = detail.records_past_target ? ", interpolated with the first record past the target" : "";
    const how = detail.extrapolated ? `the bins' trend extended, slope ${significant(detail.slope)}`
      : trend ? `the bins' trend at ${Math.round(100 * detail.run_fraction)}% of the run${bracketed}`
        : span ? "over the shaded part of the run" : detail.method;
    const name = `read: ${significant(value)} (fitted; ${how})`;
    const style = { line: { color: COLORS.fitted, width: 2, dash: detail.extrapolated ? "dash" : "solid" }, hoverinfo: "name" };
    data.push(detail.extrapolated || !span
      ? line(name, [x[x.length - 1], epochs(detail.read_at_samples)], [y[y.length - 1], value], style)
      : line(name, [span[0] * target, span[1] * target], [value, value], style));
  }
  data.push(line(`the run reaches the target (${significant(target)} epochs)`, [target, target], [Math.min(...y, value || Infinity) * 0.8, Math.max(...y, value || 0) * 1.25],
    { line: { color: COLORS.spec, width: 2, dash: "dot" }, hoverinfo: "name" }));
  const layout = baseLayout("epochs of the run", "noise scale B (samples)", { shapes });
  const reach = [...y, ...(value ? [value] : [])];
  Object.assign(layout.xaxis, logTicks(Math.min(...x), Math.max(...x, target)));
  layout.yaxis = { ...layout.yaxis, ...LOG_AXIS, ...logTicks(Math.min(...reach), Math.max(...reach)) };
  const used = read.source === efficiency.evidence.used;
  return { data, layout, used, source: read.source };
}

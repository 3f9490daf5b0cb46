// Plotly figures of a live run (GET /v1/runs/{id}, its telemetry and its job's recommendation): pure
// functions from data to {data, layout}. Nothing here fits or predicts: the predicted lines are the job's
// plan (recommendation.chosen), the rest is what the training loop reported.

const LAYOUT = {
  autosize: true, margin: { l: 64, r: 16, t: 12, b: 48 }, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
  font: { size: 12 }, hovermode: "closest", legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" },
};
const AXIS = { gridcolor: "#e5e5e5", zeroline: false };
const COLORS = { measured: "#1f77b4", predicted: "#ff7f0e", batch: "#2ca02c" };

function layout(xTitle, yTitle, extra = {}) {
  return { ...LAYOUT, xaxis: { ...AXIS, title: { text: xTitle } }, yaxis: { ...AXIS, title: { text: yTitle } }, ...extra };
}

// The global batch a record trained at: its own fields, else the run's starting configuration.
export function globalBatch(record, start) {
  const devices = record.placement ? record.placement.reduce((a, b) => a + b, 0) : start.devices;
  return (record.device_batch ?? start.device_batch) * devices * (record.accumulation ?? start.accumulation);
}

export function progressFigure(records, chosen) {
  const timed = records.filter((r) => r.wall_time_s !== undefined && r.samples !== undefined);
  const data = [{ type: "scatter", mode: "lines+markers", name: "samples seen (measured)", x: timed.map((r) => r.wall_time_s),
    y: timed.map((r) => r.samples), line: { color: COLORS.measured } }];
  const stepS = chosen?.step_time_s?.value;
  if (stepS && timed.length) {
    const end = timed[timed.length - 1].wall_time_s;
    data.push({ type: "scatter", mode: "lines", name: `the plan's pace (${chosen.step_time_s.source})`, x: [0, end],
      y: [0, (end / stepS) * chosen.global_batch], line: { color: COLORS.predicted, dash: "dash" }, hoverinfo: "skip" });
  }
  return { data, layout: layout("wall time (s)", "samples") };
}

export function stepTimeFigure(records, chosen) {
  const timed = records.filter((r) => r.step_time_s !== undefined);
  const data = [{ type: "scatter", mode: "markers", name: "step time (measured)", x: timed.map((r) => r.step),
    y: timed.map((r) => r.step_time_s), marker: { color: COLORS.measured, size: 6 } }];
  if (chosen?.step_time_s?.value && timed.length) {
    data.push({ type: "scatter", mode: "lines", name: `plan (${chosen.step_time_s.source})`,
      x: [timed[0].step, timed[timed.length - 1].step], y: [chosen.step_time_s.value, chosen.step_time_s.value],
      line: { color: COLORS.predicted, dash: "dash" }, hoverinfo: "skip" });
  }
  return { data, layout: layout("step", "seconds") };
}

// The step where a record's statistics were taken: its statistics_samples, counted back from the window's end at the
// record's global batch (under sparse sampling a window's statistics come from its first steps), else the record's step.
export function statisticsStep(record, start) {
  if (record.statistics_samples === undefined || record.samples === undefined) return record.step;
  return record.step - (record.samples - record.statistics_samples) / globalBatch(record, start);
}

export function noiseFigure(records, start) {
  const stats = records.filter((r) => r.grad_sqr !== undefined && r.trace_sigma !== undefined && r.grad_sqr > 0);
  return {
    data: [
      { type: "scatter", mode: "markers", name: "B_simple (measured)", x: stats.map((r) => statisticsStep(r, start)),
        y: stats.map((r) => r.trace_sigma / r.grad_sqr), marker: { color: COLORS.measured, size: 6 } },
      { type: "scatter", mode: "lines", name: "global batch", x: records.map((r) => r.step),
        y: records.map((r) => globalBatch(r, start)), line: { color: COLORS.batch, shape: "hv" } },
    ],
    layout: layout("step", "samples", { yaxis: { ...AXIS, type: "log", title: { text: "samples" }, tickformat: "~g" } }),
  };
}

export function lrFigure(records) {
  const withLr = records.filter((r) => r.lr !== undefined);
  return {
    data: [{ type: "scatter", mode: "lines", name: "LR (reported)", x: withLr.map((r) => r.step), y: withLr.map((r) => r.lr),
      line: { color: COLORS.measured, shape: "hv" } }],
    layout: layout("step", "learning rate"),
  };
}

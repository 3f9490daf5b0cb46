// The run page: the run's configuration and decisions, its telemetry drawn against the job's plan, and the
// advice for its next interval on request. Polls every POLL_MS.

import { api } from "./api.js";
import { el, replaceChildren, showBanner, table } from "./dom.js";
import { configText, significant } from "./format.js";
import { draw } from "./plots.js";
import { lrFigure, noiseFigure, progressFigure, stepTimeFigure } from "./run_plots.js";

const POLL_MS = 5000;
const PAGE = 1000;
const header = document.getElementById("run-header");
const runId = header.dataset.runId;
let recommendation = null;

async function allTelemetry() {
  const records = [];
  for (let offset = 0; offset !== null;) {
    const page = await api(`/v1/runs/${encodeURIComponent(runId)}/telemetry?limit=${PAGE}&offset=${offset}`);
    records.push(...page.records);
    offset = page.next_offset;
  }
  return records;
}

function showConfig(run) {
  const config = run.config;
  const lr = config.lr ? ` · LR ${significant(config.lr.value)} (${config.lr.source})` : "";
  replaceChildren(document.getElementById("run-config"), el("strong", {}, "Train with: "), configText(config), lr,
    ` · AGS δ ${significant(config.ags.delta.value)}, s ${significant(config.ags.s.value)} (from ${config.source})`);
  replaceChildren(document.getElementById("run-summary"), "Job ", el("a", { href: `/jobs/${run.job_id}` }, run.job_id),
    ` · hysteresis ${Math.round(run.options.hysteresis * 100)}% · at least ${run.options.min_steps_between_changes} steps between changes`);
  document.getElementById("run-records").textContent = `${run.records} records · step ${run.last_step ?? "–"}`;
  const decisions = run.decisions;
  document.getElementById("run-no-decisions").hidden = decisions.length > 0;
  replaceChildren(document.getElementById("run-decisions"), decisions.length ? table(["step", "from", "to", "why"],
    decisions.map((d) => [String(d.step), `${d.from.global_batch}`, `${d.to.global_batch}`, d.why])) : []);
}

async function refresh() {
  try {
    const run = await api(`/v1/runs/${encodeURIComponent(runId)}`);
    if (!recommendation) recommendation = await api(`/v1/jobs/${encodeURIComponent(run.job_id)}/recommendation`);
    showConfig(run);
    const records = await allTelemetry();
    const chosen = recommendation.chosen;
    draw(document.getElementById("plot-progress"), progressFigure(records, chosen));
    draw(document.getElementById("plot-step-time"), stepTimeFigure(records, chosen));
    draw(document.getElementById("plot-noise"), noiseFigure(records, chosen));
    draw(document.getElementById("plot-lr"), lrFigure(records));
    header.dataset.drawn = String(records.length);
  } catch (error) {
    showBanner(`Could not load run ${runId}: ${error.message}`);
  }
}

// The answer's why, then what it rests on: the noise scale and where it came from, and the LR cap, when one
// was measured (the stability headroom, live or the job's).
function adviceText(plan) {
  const evidence = plan.evidence || {};
  const parts = [(plan.changed ? "Changed: " : "") + plan.why];
  if (evidence.noise_scale) {
    const calibrated = evidence.noise_scale.calibrated_interval?.value; // the model's error across tasks (epochs_calibration.py)
    const range = calibrated ? ` (80%: ${significant(calibrated[0])}-${significant(calibrated[1])})` : "";
    const why = evidence.noise_scale_why ? ` (${evidence.noise_scale_why})` : ""; // why this evidence, and not the other
    parts.push(`B_noise ${significant(evidence.noise_scale.value)}${range} from the ${evidence.noise_scale_from.replace(/^the /, "")}${why}`);
  }
  if (evidence.lr_headroom) {
    parts.push(`LR at most ${significant(evidence.lr_headroom.value)}x the reference (stability headroom; ${evidence.lr_headroom.evidence})`);
  }
  return parts.join(" · ");
}

document.getElementById("run-advise").addEventListener("click", async () => {
  const out = document.getElementById("run-advice");
  out.textContent = "re-planning…";
  try {
    const plan = await api(`/v1/runs/${encodeURIComponent(runId)}/plan`);
    out.textContent = adviceText(plan);
    await refresh();
  } catch (error) {
    out.textContent = error.message;
  }
});

function whenPlotly(then) {
  if (window.Plotly) then();
  else window.addEventListener("load", then, { once: true });
}

whenPlotly(() => {
  refresh();
  setInterval(refresh, POLL_MS);
});

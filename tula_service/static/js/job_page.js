// Job page: live progress (GET /v1/jobs/{id}?points=false and GET /v1/jobs/{id}/points every second
// until the job ends), then the recommendation, its plots and the what-if controls (POST /v1/jobs/{id}/plan).

import { api } from "./api.js";
import { clusterText } from "./format.js";
import { clearErrors, showFieldError, showProblem } from "./forms.js";
import { draw, efficiencyFigure, iterTimeFigure, memoryFigure, noiseTrajectoryFigure, paretoFigure, throughputFigure } from "./plots.js";
import { renderFailedPoints, renderPoints } from "./points.js";
import { renderErrorTable, renderRecommendation, renderRunnerUps } from "./recommendation.js";
import { FieldError, WHAT_IF_ALIASES, fillWhatIf, whatIfRequest } from "./whatif.js";

const POLL_MS = 1000;
const POINTS_PAGE = 500; // the most GET /v1/jobs/{id}/points gives at once
const $ = (id) => document.getElementById(id);
const jobId = $("job-header").dataset.jobId;
const TERMINAL = new Set($("job-header").dataset.terminalStates.split(" ")); // the server's, from the page shell
const jobPath = `/v1/jobs/${encodeURIComponent(jobId)}`;
const whatIfForm = $("what-if-form");
const page = { job: null, stored: null, gpus: [] };

function renderHeader(job) {
  $("job-title").replaceChildren(job.name || "Job", " ", Object.assign(document.createElement("code"), { textContent: job.id }));
  document.title = `${job.name || job.id} · Tula`;
  const state = $("job-state");
  state.textContent = job.state;
  state.className = `state state-${job.state}`;
  const spec = job.spec;
  const loss = spec.loss ? ` · loss ${spec.loss}` : ""; // the default (cross-entropy) goes unsaid
  $("job-summary").textContent = `${job.model} on ${job.dataset} (${spec.dataset.num_samples} samples per epoch)${loss} · `
    + `cluster ${clusterText(spec.cluster)} · batch sizes ${spec.batch_sizes.join(", ")} · objective ${spec.objective}`;
  const { points_done: done, points_total: total, points_failed: failed, points_retried: retried } = job.progress;
  const bar = $("job-progress");
  bar.max = Math.max(total, 1);
  bar.value = done;
  $("job-progress-text").textContent = `${done}/${total} points`
    + (failed ? `, ${failed} failed` : "") + (retried ? `, ${retried} retried` : "");
  $("job-step").textContent = job.progress.step;
}

// A banner, not a badge: an unreliable profile is the first thing the page says about the result.
function renderReliability(reliability) {
  const unreliable = reliability?.verdict === "unreliable";
  $("job-unreliable").hidden = !unreliable;
  if (!unreliable) return;
  $("job-unreliable-title").textContent = reliability.message.charAt(0).toUpperCase() + reliability.message.slice(1);
  $("job-unreliable-reasons").replaceChildren(...reliability.reasons.map((reason) => Object.assign(document.createElement("li"), { textContent: reason })));
}

// The run the noise scale was read from (plots.noiseTrajectoryFigure); hidden when none was.
function renderNoiseTrajectory(rec) {
  const figure = noiseTrajectoryFigure(rec, page.job.spec);
  $("noise-trajectory-card").hidden = !figure;
  if (!figure) return;
  draw($("plot-noise-trajectory"), figure);
  const from = figure.source.replace("_", " ");
  const used = rec.models.efficiency.evidence.used;
  $("noise-trajectory-note").textContent = (figure.used ? `The epochs model's B_noise was read from the ${from}'s records.`
    : used === "other_runs" ? `The ${from}'s records: their noise scale is the prior of the fit to your other runs.`
      : `The ${from}'s records did not give the noise scale used (${(used || "none").replace("_", " ")}): see the warnings.`)
    + " The noise scale grows as the loss falls, so one value is read for the run to the target: over the shaded part of it;"
    + " with too few records there, the trend of the bins at its middle (interpolated with the first record past the target"
    + " where the records before it stop short); or, where the records stop short and none go past, the trend of the last"
    + " bins extended (weak evidence).";
}

function renderResult(rec, whatIf) {
  const context = {
    jobId,
    whatIf: Boolean(whatIf),
    whatIfBody: whatIf?.body ?? null,
    whatIfText: whatIf ? whatIf.changes.join("; ") : "",
  };
  renderReliability(rec.reliability);
  renderRecommendation($("recommendation-body"), rec, context);
  renderErrorTable($("error-table"), rec);
  renderRunnerUps($("runner-ups"), rec);
  draw($("plot-pareto"), paretoFigure(rec));
  draw($("plot-iter-time"), iterTimeFigure(rec));
  draw($("plot-throughput"), throughputFigure(rec));
  draw($("plot-memory"), memoryFigure(rec));
  draw($("plot-efficiency"), efficiencyFigure(rec, page.job.spec));
  $("efficiency-note").textContent = rec.models.efficiency.note;
  renderNoiseTrajectory(rec);
  $("job-result").dataset.plan = whatIf ? "what-if" : "stored";
}

async function showResult(job) {
  const [rec, gpus] = await Promise.all([
    api(`${jobPath}/recommendation`),
    api("/v1/catalog/gpus").then((listing) => listing.gpus, () => []),
  ]);
  page.stored = rec;
  page.gpus = gpus;
  $("job-result").hidden = false;
  fillWhatIf(whatIfForm, job.spec, gpus);
  renderResult(rec, null);
}

function showFailure(job, points) {
  $("job-failure").hidden = false;
  $("job-error").textContent = job.error || "the job failed without an error message";
  renderFailedPoints($("failed-points"), points);
}

async function allPoints() {
  const points = [];
  for (let offset = 0; offset !== null;) {
    const pointsPage = await api(`${jobPath}/points?limit=${POINTS_PAGE}&offset=${offset}`);
    points.push(...pointsPage.points);
    offset = pointsPage.next_offset;
  }
  return points;
}

async function poll() {
  let job, points;
  try {
    // The job first, then its points: once the job has ended its points have too, so the last table
    // drawn shows them finished.
    job = await api(`${jobPath}?points=false`);
    points = await allPoints();
  } catch (error) {
    $("job-step").textContent = error.status === 404 ? `No job ${jobId} on this server.` : `Could not load the job: ${error.message}`;
    if (error.status !== 404) setTimeout(poll, error.status === 401 ? 5 * POLL_MS : POLL_MS);
    return;
  }
  page.job = job;
  renderHeader(job);
  renderPoints($("points-table"), points);
  if (!TERMINAL.has(job.state)) {
    setTimeout(poll, POLL_MS);
    return;
  }
  if (job.state === "failed") showFailure(job, points);
  if (job.state === "done") {
    try {
      await showResult(job);
    } catch (error) {
      $("job-step").textContent = `Could not load the recommendation: ${error.message}`;
    }
  }
}

async function replan(event) {
  event.preventDefault();
  clearErrors(whatIfForm);
  const status = $("what-if-status");
  let request;
  try {
    request = whatIfRequest(whatIfForm, page.job.spec);
  } catch (error) {
    if (!(error instanceof FieldError)) throw error;
    showFieldError(whatIfForm, error.field, error.message);
    return;
  }
  if (!request.body) {
    status.textContent = "Nothing changed: showing the stored plan.";
    renderResult(page.stored, null);
    return;
  }
  status.textContent = "Re-planning…";
  $("what-if-submit").disabled = true;
  try {
    const rec = await api(`${jobPath}/plan`, { method: "POST", body: request.body });
    renderResult(rec, request);
    status.textContent = `Re-planned: ${request.changes.join("; ")}.`;
  } catch (error) {
    status.textContent = "";
    showProblem(whatIfForm, error, WHAT_IF_ALIASES);
  } finally {
    $("what-if-submit").disabled = false;
  }
}

whatIfForm.addEventListener("submit", replan);
$("what-if-reset").addEventListener("click", () => {
  clearErrors(whatIfForm);
  fillWhatIf(whatIfForm, page.job.spec, page.gpus);
  $("what-if-status").textContent = "";
  renderResult(page.stored, null);
});
window.addEventListener("tula:token-changed", () => { if (!page.job) poll(); });
poll();

// Jobs page: the job list, polled every second, with a progress bar per job.

import { api } from "./api.js";
import { el, replaceChildren } from "./dom.js";
import { clusterText, formatTime } from "./format.js";

const POLL_MS = 1000;
const body = document.querySelector("#jobs-table tbody");
const summary = document.getElementById("jobs-summary");

function progressCell(job) {
  const { points_done: done, points_total: total, points_failed: failed } = job.progress;
  return el("div", { class: "progress-row" },
    el("progress", { value: done, max: Math.max(total, 1), "aria-label": `${done} of ${total} points finished` }),
    el("span", { class: "nowrap progress-text" }, `${done}/${total}`, failed ? ` (${failed} failed)` : ""));
}

function chosenCell(job) {
  if (!job.chosen) return job.state === "done" ? "–" : "";
  const row = job.chosen;
  return el("span", { class: "nowrap", title: "global batch = per device × devices × accumulation" },
    el("strong", {}, String(row.global_batch)), ` = ${row.device_batch} × ${row.devices} × ${row.accumulation}`);
}

function jobRow(job) {
  return el("tr", { "data-job-id": job.id, "data-state": job.state },
    el("td", {}, el("a", { href: `/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id.slice(0, 8))),
    el("td", {}, job.model),
    el("td", {}, job.dataset),
    el("td", {}, clusterText(job.cluster)),
    el("td", {}, el("span", { class: `state state-${job.state}` }, job.state)),
    el("td", { class: "progress-cell" }, progressCell(job)),
    el("td", { class: "chosen" }, chosenCell(job)),
    el("td", { class: "nowrap" }, formatTime(job.created_at)));
}

async function refresh() {
  try {
    const listing = await api("/v1/jobs?limit=100");
    replaceChildren(body, listing.jobs.map(jobRow));
    summary.textContent = listing.total
      ? `${listing.total} job${listing.total === 1 ? "" : "s"}, newest first${listing.total > listing.jobs.length ? ` (showing ${listing.jobs.length})` : ""}; updated every second.`
      : "No jobs yet: submit one with “New job”.";
  } catch (error) {
    summary.textContent = `Could not load the jobs: ${error.message}`;
  }
}

async function loop() {
  if (!document.hidden) await refresh();
  setTimeout(loop, POLL_MS);
}

window.addEventListener("tula:token-changed", refresh);
loop();

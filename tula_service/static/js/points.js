// Profiling points: every point of a job, and the failing ones with their errors.

import { el, replaceChildren, table } from "./dom.js";
import { formatDuration } from "./format.js";

function what(point) {
  if (point.kind === "comm") return "all-reduce";
  if (point.kind === "pilot") return `pilot at batch ${point.batch_size}`;
  return `batch ${point.batch_size}${point.kind === "search" ? " (max-batch search)" : ""}`;
}

// `points`: the job's points, every page of GET /v1/jobs/{id}/points.
export function renderPoints(node, points) {
  replaceChildren(node, table(["point", "state", "attempts", "duration", "worker", "error"],
    points.map((p) => [what(p), el("span", { class: `state state-${p.state}` }, p.state), String(p.attempts),
      p.duration_s === null ? "–" : `${formatDuration(p.duration_s)} (measured)`, p.worker || "–",
      p.error ? el("span", { class: "error-text" }, p.error) : ""])));
}

export function renderFailedPoints(node, points) {
  const failing = points.filter((p) => p.state === "failed" || p.attempt_errors.length);
  replaceChildren(node, table(["point", "state", "attempts", "error", "earlier attempts"],
    failing.map((p) => [what(p), p.state, String(p.attempts),
      el("pre", { class: "error-text point-error" }, p.error || "–"),
      p.attempt_errors.length ? el("ol", {}, p.attempt_errors.map((e) => el("li", {}, e))) : "–"])));
  node.dataset.rows = String(failing.length);
}

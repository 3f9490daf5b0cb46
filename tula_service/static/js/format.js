// Numbers with their unit, and where each came from (the API's {value, source} pairs).

import { el } from "./dom.js";

const GIB = 2 ** 30;
const MIB = 2 ** 20;

export function significant(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (!Number.isFinite(value)) return value > 0 ? "∞" : "-∞";
  if (value !== 0 && Math.abs(value) < 1e-3) return value.toExponential(digits - 1);
  const text = Number(value.toPrecision(digits));
  return Math.abs(text) >= 1e6 ? text.toExponential(digits - 1) : text.toLocaleString("en-US", { maximumFractionDigits: 6 });
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return `${significant(seconds * 1000)} ms`;
  if (seconds < 120) return `${significant(seconds)} s`;
  if (seconds < 2 * 3600) return `${significant(seconds / 60)} min`;
  if (seconds < 72 * 3600) return `${significant(seconds / 3600)} h`;
  return `${significant(seconds / 86400)} d`;
}

export function formatUsd(usd) {
  if (usd === null || usd === undefined) return "–";
  return usd >= 100 ? `$${Math.round(usd).toLocaleString("en-US")}` : `$${significant(usd)}`;
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  return bytes >= GIB ? `${significant(bytes / GIB)} GiB` : `${significant(bytes / MIB)} MiB`;
}

export function formatPercent(fraction, digits = 2) {
  if (fraction === null || fraction === undefined) return "–";
  if (fraction !== 0 && Math.abs(fraction) < 1e-4) return "<0.01%";
  return `${significant(100 * fraction, digits)}%`;
}

export function formatTime(iso) {
  if (!iso) return "–";
  const moment = new Date(iso);
  return moment.toLocaleString(undefined, { dateStyle: "short", timeStyle: "short" });
}

const SOURCE_MEANING = {
  measured: "read from a profiling point as is",
  fitted: "a parameter fitted to the measurements",
  predicted: "computed from the fitted models",
  assumed: "a stated default in place of a measurement",
  spec: "given in the job spec",
  "catalog-assumed": "taken from the GPU catalog (spec sheet, list price)",
  rule: "a published rule of thumb applied to the numbers above",
};

// A badge saying where a number came from; predicted values carry their leave-one-out error.
export function sourceBadge(source, relErr) {
  const error = relErr !== undefined && relErr !== null ? ` ±${formatPercent(relErr)}` : "";
  return el("span", {
    class: `source source-${source}`,
    title: `${source}: ${SOURCE_MEANING[source] || "see the API docs"}${error ? `; median leave-one-out error${error}` : ""}`,
  }, `${source}${error}`);
}

// "{value, source}" -> [formatted value, badge]
export function sourced(quantity, format = significant) {
  if (!quantity) return "–";
  return el("span", { class: "sourced" }, el("span", { class: "value" }, format(quantity.value)), " ",
    sourceBadge(quantity.source, quantity.rel_err));
}

export function clusterText(cluster) {
  const device = cluster.gpu_type ? cluster.gpu_type : `${significant(cluster.device_memory_gib)} GiB devices`;
  return `${cluster.nodes} × ${cluster.gpus_per_node} ${device}`;
}

export function configText(row) {
  return `${row.global_batch} = ${row.device_batch} per device × ${row.devices} device${row.devices === 1 ? "" : "s"}`
    + ` × ${row.accumulation} accumulation`;
}

// What-if controls: filled from the job's stored spec; only the values changed go to
// POST /v1/jobs/{id}/plan, so values the user did not touch keep their stored source.

import { el, replaceChildren } from "./dom.js";
import { numberValue } from "./forms.js";

// API paths whose field is shown under another name here ("devices" stands for cluster.nodes).
export const WHAT_IF_ALIASES = { "cluster.nodes": "cluster.devices" };

export function fillWhatIf(form, spec, gpus) {
  const cluster = spec.cluster;
  form.elements.devices.value = String(cluster.nodes * cluster.gpus_per_node);
  form.elements.gpus_per_node.value = String(cluster.gpus_per_node);
  const gpuOptions = cluster.gpu_type ? [] : [el("option", { value: "" }, `profiled device, ${cluster.device_memory_gib} GiB (spec)`)];
  for (const gpu of gpus) {
    gpuOptions.push(el("option", { value: gpu.name }, `${gpu.name}: ${gpu.memory_gib} GiB, $${gpu.default_price_usd_per_hour}/GPU-hour`));
  }
  replaceChildren(form.elements.gpu_type, gpuOptions);
  form.elements.gpu_type.value = cluster.gpu_type || "";
  form.elements.pricing_kind.value = spec.pricing.kind;
  form.elements.price.value = String(spec.pricing.price);
  form.elements.objective.value = spec.objective;
  form.elements.deadline_h.value = spec.deadline_h ?? "";
  form.elements.budget_usd.value = spec.budget_usd ?? "";
}

export class FieldError extends Error {
  constructor(field, message) {
    super(message);
    this.field = field;
  }
}

// {body, changes}: the what-if request and, in words, what it changes; body is null when nothing changed.
export function whatIfRequest(form, spec) {
  const values = form.elements;
  const stored = spec.cluster;
  const changes = [];
  const cluster = {};
  const pricing = {};
  const body = {};
  const devices = numberValue(values.devices);
  const gpusPerNode = numberValue(values.gpus_per_node);
  if (gpusPerNode !== undefined && gpusPerNode !== stored.gpus_per_node) {
    cluster.gpus_per_node = gpusPerNode;
    changes.push(`GPUs per node ${stored.gpus_per_node} → ${gpusPerNode}`);
  }
  const perNode = cluster.gpus_per_node ?? stored.gpus_per_node;
  if (devices !== undefined && (devices !== stored.nodes * stored.gpus_per_node || "gpus_per_node" in cluster)) {
    if (!Number.isInteger(devices) || !Number.isInteger(perNode) || devices % perNode !== 0) {
      throw new FieldError("cluster.devices", `${devices} devices are not a whole number of nodes of ${perNode} GPUs`);
    }
    cluster.nodes = devices / perNode;
    changes.push(`devices ${stored.nodes * stored.gpus_per_node} → ${devices} (${cluster.nodes} nodes)`);
  }
  if (values.gpu_type.value && values.gpu_type.value !== (stored.gpu_type || "")) {
    cluster.gpu_type = values.gpu_type.value;
    changes.push(`GPU type → ${cluster.gpu_type}`);
  }
  if (values.pricing_kind.value !== spec.pricing.kind) {
    pricing.kind = values.pricing_kind.value;
    changes.push(`pricing ${spec.pricing.kind} → ${pricing.kind}`);
  }
  const price = numberValue(values.price);
  if (price !== undefined && price !== spec.pricing.price) {
    pricing.price = price;
    changes.push(`price ${spec.pricing.price} → ${price} USD`);
  }
  if (values.objective.value !== spec.objective) {
    body.objective = values.objective.value;
    changes.push(`objective ${spec.objective} → ${body.objective}`);
  }
  for (const [name, label, unit] of [["deadline_h", "deadline", "h"], ["budget_usd", "budget", "USD"]]) {
    const value = numberValue(values[name]);
    if (value !== undefined && value !== spec[name]) {
      body[name] = value;
      changes.push(`${label} ${value} ${unit}`);
    }
  }
  if (Object.keys(cluster).length) body.cluster = cluster;
  if (Object.keys(pricing).length) body.pricing = pricing;
  return { body: Object.keys(body).length ? body : null, changes };
}

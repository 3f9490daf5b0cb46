// New job: a form built from the catalog; the spec goes to POST /v1/jobs, the API's errors come back
// next to their fields, and a created job opens its page.

import { api, newIdempotencyKey } from "./api.js";
import { el, replaceChildren } from "./dom.js";
import { clearErrors, numberValue, showFieldError, showProblem } from "./forms.js";

const form = document.getElementById("job-form");
const field = (name) => form.elements.namedItem(name);
const status = document.getElementById("submit-status");
const catalog = { models: new Map(), datasets: new Map(), losses: new Map(), gpus: new Map() };
const PREFERRED = { model: "small_cnn", image: "synthetic_images", tokens: "synthetic_tokens" };
let lastSubmission = { body: null, key: null };

function option(value, text, selected = false) {
  return el("option", { value, selected }, text);
}

function fillModels() {
  const names = [...catalog.models.keys()].sort();
  replaceChildren(field("model"), names.map((name) => option(name, name, name === PREFERRED.model)));
}

function modelChanged() {
  const info = catalog.models.get(field("model").value);
  document.getElementById("model-description").textContent = info ? info.description : "";
  const options = document.getElementById("model-options");
  const inputs = Object.entries(info?.options || {}).map(([name, value]) =>
    el("label", { "data-field": `model_options.${name}` }, `Model option: ${name}`,
      typeof value === "boolean"
        ? el("input", { type: "checkbox", name: `model_option:${name}`, checked: value })
        : el("input", { type: typeof value === "number" ? "number" : "text", name: `model_option:${name}`, value: String(value), step: "any" }),
      el("span", { class: "field-error", "data-error-for": `model_options.${name}` })));
  replaceChildren(options, inputs, el("span", { class: "field-error", "data-error-for": "model_options" }));
  options.hidden = inputs.length === 0;
  const datasets = [...catalog.datasets.values()].filter((d) => !info || d.input_kind === info.input_kind);
  const current = field("dataset_name").value;
  const keep = datasets.some((d) => d.name === current) ? current : (PREFERRED[info?.input_kind] ?? datasets[0]?.name);
  replaceChildren(field("dataset_name"), datasets.map((d) => option(d.name, d.name, d.name === keep)));
  datasetChanged();
}

function datasetChanged() {
  const info = catalog.datasets.get(field("dataset_name").value);
  document.getElementById("dataset-description").textContent = info ? info.description : "";
  const fixed = info?.fixed_num_samples;
  field("num_samples").disabled = Boolean(fixed);
  if (fixed) field("num_samples").value = String(fixed);
  const inputs = Object.entries(info?.fields || {}).map(([name, value]) => {
    const required = info.required.includes(name);
    const text = name.charAt(0).toUpperCase() + name.slice(1).replaceAll("_", " ");
    return el("label", { "data-field": `dataset.${name}` }, `${text}${required ? " (required)" : ""}`,
      el("input", { type: name === "path" || typeof value === "string" ? "text" : "number", name: `dataset_field:${name}`, value: value === null ? "" : String(value), step: "1", spellcheck: "false" }),
      el("span", { class: "field-error", "data-error-for": `dataset.${name}` }));
  });
  replaceChildren(document.getElementById("dataset-fields"), inputs);
  fillLosses(info);
}

// The losses that take the dataset's targets (class labels, or a regression's floats); "" leaves the spec's loss out,
// so the dataset's own default trains (cross-entropy, or mse on float targets). A user loss: the advanced JSON.
function fillLosses(info) {
  const targets = info?.targets || "labels";
  const fallback = info?.default_loss || "cross_entropy";
  const others = [...catalog.losses.values()].filter((l) => l.targets === targets && l.name !== fallback);
  const current = field("loss").value;
  replaceChildren(field("loss"), [option("", `${fallback} (the dataset's default)`),
    ...others.map((l) => option(l.name, l.name, l.name === current))]);
  lossChanged();
}

function lossChanged() {
  const info = catalog.losses.get(field("loss").value || catalog.datasets.get(field("dataset_name").value)?.default_loss || "cross_entropy");
  document.getElementById("loss-description").textContent = info ? info.description : "";
}

function fillGpus() {
  const select = field("gpu_type");
  for (const gpu of [...catalog.gpus.values()]) {
    select.append(option(gpu.name, `${gpu.name}: ${gpu.memory_gib} GiB, $${gpu.default_price_usd_per_hour}/GPU-hour (catalog)`));
  }
}

function objectiveChanged() {
  const objective = field("objective").value;
  field("deadline_h").closest("label").hidden = objective !== "deadline";
  field("budget_usd").closest("label").hidden = objective !== "budget";
}

function batchSizes(text) {
  return text.split(/[\s,;]+/).filter(Boolean).map((word) => (/^\d+$/.test(word) ? Number(word) : word));
}

function prefixed(prefix, parse) {
  const values = {};
  for (const input of form.querySelectorAll(`[name^="${prefix}:"]`)) {
    const name = input.name.slice(prefix.length + 1);
    const value = input.type === "checkbox" ? input.checked : parse(input);
    if (value !== undefined) values[name] = value;
  }
  return values;
}

function withoutUndefined(object) {
  return Object.fromEntries(Object.entries(object).filter(([, value]) => value !== undefined));
}

function deepMerge(base, extra) {
  const merged = { ...base };
  for (const [key, value] of Object.entries(extra)) {
    const isObject = (v) => v && typeof v === "object" && !Array.isArray(v);
    merged[key] = isObject(value) && isObject(base[key]) ? deepMerge(base[key], value) : value;
  }
  return merged;
}

// The spec as the API takes it (tula_service.spec.job_spec.JobSpec); blank fields are left for the API to default.
function specFromForm() {
  const text = (name) => field(name).value.trim() || undefined;
  const objective = field("objective").value;
  const datasetFields = prefixed("dataset_field", (input) => (input.type === "number" ? numberValue(input) : input.value.trim() || undefined));
  const spec = withoutUndefined({
    name: text("job_name"),
    model: field("model").value,
    model_options: prefixed("model_option", (input) => (input.type === "number" ? numberValue(input) : input.value.trim() || undefined)),
    initial_weights: text("initial_weights"),
    dataset: withoutUndefined({
      name: field("dataset_name").value,
      num_samples: field("num_samples").disabled ? undefined : numberValue(field("num_samples")),
      ...datasetFields,
    }),
    loss: text("loss"),
    batch_sizes: batchSizes(field("batch_sizes").value),
    cluster: withoutUndefined({
      nodes: numberValue(field("nodes")),
      gpus_per_node: numberValue(field("gpus_per_node")),
      gpu_type: text("gpu_type"),
      device_memory_gib: numberValue(field("device_memory_gib")),
    }),
    pricing: withoutUndefined({ kind: field("pricing_kind").value, price: numberValue(field("price")) }),
    objective,
    deadline_h: objective === "deadline" ? numberValue(field("deadline_h")) : undefined,
    budget_usd: objective === "budget" ? numberValue(field("budget_usd")) : undefined,
    training: withoutUndefined({
      reference_batch: numberValue(field("reference_batch")),
      reference_epochs: numberValue(field("reference_epochs")),
      optimizer: field("optimizer").value,
      reference_lr: numberValue(field("reference_lr")),
      max_lr: numberValue(field("max_lr")),
    }),
  });
  const advanced = field("advanced").value.trim();
  if (!advanced) return spec;
  let extra;
  try {
    extra = JSON.parse(advanced);
  } catch (error) {
    throw Object.assign(new Error(`not JSON: ${error.message}`), { field: "advanced" });
  }
  if (!extra || typeof extra !== "object" || Array.isArray(extra)) {
    throw Object.assign(new Error("give a JSON object, e.g. {\"profiling\": {\"time_cap_s\": 2}}"), { field: "advanced" });
  }
  return deepMerge(spec, extra);
}

async function submit(event) {
  event.preventDefault();
  clearErrors(form);
  let spec;
  try {
    spec = specFromForm();
  } catch (error) {
    showFieldError(form, error.field, error.message);
    return;
  }
  const body = JSON.stringify(spec);
  if (body !== lastSubmission.body) lastSubmission = { body, key: newIdempotencyKey() }; // a retry reuses its key
  const button = document.getElementById("submit-job");
  button.disabled = true;
  status.textContent = "Submitting…";
  try {
    const job = await api("/v1/jobs", { method: "POST", body: spec, headers: { "Idempotency-Key": lastSubmission.key } });
    status.textContent = `Job ${job.id} submitted.`;
    location.assign(`/jobs/${encodeURIComponent(job.id)}`);
  } catch (error) {
    status.textContent = error.status === 422 ? "The server found problems: see the fields marked." : "";
    showProblem(form, error);
  } finally {
    button.disabled = false;
  }
}

async function load() {
  try {
    const [models, datasets, losses, gpus] = await Promise.all([
      api("/v1/catalog/models"), api("/v1/catalog/datasets"), api("/v1/catalog/losses"), api("/v1/catalog/gpus")]);
    models.models.forEach((m) => catalog.models.set(m.name, m));
    datasets.datasets.forEach((d) => catalog.datasets.set(d.name, d));
    losses.losses.forEach((l) => catalog.losses.set(l.name, l));
    gpus.gpus.forEach((g) => catalog.gpus.set(g.name, g));
  } catch (error) {
    status.textContent = `Could not load the catalog: ${error.message}`;
    return;
  }
  fillModels();
  fillGpus();
  modelChanged();
  objectiveChanged();
  form.dataset.ready = "true";
}

field("model").addEventListener("change", modelChanged);
field("dataset_name").addEventListener("change", datasetChanged);
field("loss").addEventListener("change", lossChanged);
field("objective").addEventListener("change", objectiveChanged);
form.addEventListener("submit", submit);
window.addEventListener("tula:token-changed", () => { if (!form.dataset.ready) load(); });
load();

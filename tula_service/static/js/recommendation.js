// The recommendation card, its copy buttons (JSON, CLI, Python for AGS), and the error and runner-up tables.

import { el, replaceChildren, table } from "./dom.js";
import { formatBytes, formatDuration, formatPercent, formatUsd, significant, sourceBadge, sourced } from "./format.js";

const PRICE_UNIT = { gpu_hour: "per GPU-hour", node_hour: "per node-hour", memory_gb_hour: "per GiB-hour" };

function item(label, value, why) {
  return [el("dt", {}, label), el("dd", {}, value, why ? el("span", { class: "why" }, why) : null)];
}

function badged(text, source) {
  return el("span", { class: "sourced" }, el("span", { class: "value" }, text), " ", sourceBadge(source));
}

function lrItem(lr) {
  const value = [badged(`×${significant(lr.multiplier.value)} (${lr.recommended})`, lr.multiplier.source)];
  if (lr.lr) value.push(" → LR ", sourced(lr.lr));
  return item("Learning rate", value, lr.why);
}

function warmupItem(warmup) {
  const text = warmup.steps ? `${significant(warmup.epochs)} epochs (${warmup.steps} steps), ${warmup.schedule}` : "none";
  return item("Warm-up", badged(text, "assumed"), warmup.why);
}

// The recommended batch schedule (tula_service/plan/schedule.py): its stages, predicted gain and why.
function scheduleItem(schedule) {
  const stages = schedule.schedules[schedule.recommended].stages;
  const text = stages.length > 1
    ? `${schedule.recommended.replaceAll("_", " ")}: ` + stages.map((s) => `${s.global_batch} from epoch ${significant(s.from_epoch)}`).join(" → ")
    : `constant ${stages[0].global_batch}`;
  const caveats = schedule.caveats.length ? ` (${schedule.caveats.join("; ")})` : "";
  return item("Batch schedule", badged(text, "predicted"), schedule.why + caveats);
}

function agsItems(ags) {
  return [
    ...item("AGS δ (variability threshold)", sourced(ags.delta), ags.delta.why),
    ...item("AGS s (update scale)", sourced(ags.s), ags.s.why),
  ];
}

export function renderRecommendation(container, rec, context) {
  const chosen = rec.chosen;
  const lr = rec.training_advice.lr_rule;
  const efficiency = rec.models.efficiency;
  const how = rec.knee && rec.objective === "knee"
    ? `the knee of the Pareto front (${rec.knee.method}, S = ${rec.knee.sensitivity})`
    : `objective ${rec.objective}`;
  const price = rec.pricing.price;
  replaceChildren(container,
    context.whatIf ? el("p", { class: "what-if-note" }, "What-if: ", context.whatIfText) : null,
    rec.constraint ? el("p", { class: rec.constraint.met ? "ok-text" : "error-text" }, rec.constraint.message) : null,
    el("p", { class: "headline" },
      "Global batch ", el("strong", { id: "chosen-global-batch" }, String(chosen.global_batch)), " = ",
      el("strong", {}, String(chosen.device_batch)), " per device × ",
      el("strong", { id: "chosen-devices" }, String(chosen.devices)), ` device${chosen.devices === 1 ? "" : "s"} × `,
      el("strong", {}, String(chosen.accumulation)), " accumulation"),
    el("p", { class: "hint" }, `Chosen by ${how} from the predicted time and cost of ${rec.candidates.length} candidates.`,
      rec.knee?.method_explained && rec.objective === "knee" ? el("span", { id: "knee-method" }, ` ${rec.knee.method}: ${rec.knee.method_explained}.`) : null),
    el("dl", { class: "facts" },
      item("Total time", withCalibrated(chosen.total_time_s, formatDuration)),
      item("Cost", withCalibrated(chosen.cost_usd, formatUsd)),
      item("Epochs", withCalibrated(chosen.epochs, significant)),
      item("Iteration time", sourced(chosen.iter_time_s, formatDuration)),
      item("Memory per device", [sourced(chosen.memory_bytes, formatBytes), " of ",
        sourced(rec.device.memory_gib, (gib) => `${significant(gib)} GiB`)]),
      item("Price", sourced(price, (usd) => `${formatUsd(usd)} ${PRICE_UNIT[rec.pricing.kind]}`)),
      efficiency.noise_scale ? noiseScaleItem(efficiency) : [],
      nextRunItem(efficiency.next_run),
      lrItem(lr),
      warmupItem(rec.training_advice.warmup),
      scheduleItem(rec.training_advice.batch_schedule),
      agsItems(rec.training_advice.ags)),
    copyBlock("JSON", "copy-json", JSON.stringify(rec, null, 2), false),
    copyBlock("CLI command", "copy-cli", cliCommand(context.jobId, context.whatIfBody, location.origin), true),
    copyBlock("Python (AGS)", "copy-python", agsSnippet(rec, context.jobId), false),
  );
}

// A sourced value and, where the noise scale has one, the 80% interval its epochs' calibrated error gives (not shown
// where it closes, at the reference batch).
function withCalibrated(quantity, format) {
  const [low, high] = (quantity?.calibrated_interval || []).map((value) => format(value));
  return low !== undefined && low !== high
    ? [sourced(quantity, format), el("span", { class: "calibrated" }, ` (80%: ${low} – ${high})`)]
    : sourced(quantity, format);
}

// B_noise with its interval and the evidence it was read from (efficiency_evidence.py), and why it may be weak.
function noiseScaleItem(efficiency) {
  const noise = efficiency.noise_scale;
  // an en dash, not ", ": "[36, 405,000]" reads as three numbers
  const range = noise.interval ? ` [${significant(noise.interval[0])} – ${significant(noise.interval[1])}]` : "";
  const calibrated = noise.calibrated_interval
    ? `; 80% interval ${significant(noise.calibrated_interval.value[0])}-${significant(noise.calibrated_interval.value[1])} (the model's error across tasks)`
    : "";
  // a fine-tuning job's pilot and points trained from its checkpoint (detail.started_from); a random init goes unsaid
  const used = (efficiency.evidence?.candidates || []).find((candidate) => candidate.source === noise.evidence);
  const start = used?.detail?.started_from || "";
  const started = start.startsWith("initial_weights") ? `, started from ${start}` : "";
  const text = `${significant(noise.value)}${range} from the ${String(noise.evidence || "").replace("_", " ")}${started}${calibrated}`;
  const why = [efficiency.note, noise.calibrated_interval?.why, ...(efficiency.warnings || [])].filter(Boolean).join(" ");
  return item("Noise scale", badged(text + (efficiency.weak ? " (weak evidence)" : ""), "fitted"), why);
}

// The run whose epochs would settle the epochs model (efficiency_evidence.next_run), until runs are given.
function nextRunItem(run) {
  if (!run) return [];
  const interval = run.predicted_epochs_interval;
  const range = interval ? ` (80%: ${significant(interval[0])} – ${significant(interval[1])})` : "";
  return item("Measure next", [el("span", { id: "next-run-batch" }, `global batch ${run.batch}`), " to the same target: ",
    badged(`${significant(run.predicted_epochs)} epochs predicted now${range}`, "predicted")], run.why);
}

function copyBlock(label, id, text, open) {
  const button = el("button", { type: "button", class: "secondary copy", id, "data-copy": label },
    `Copy ${label}`);
  button.addEventListener("click", () => copyText(text).then(
    () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = `Copy ${label}`; }, 1500); },
    (error) => { button.textContent = `Copy failed: ${error.message}`; }));
  return el("details", { class: "copy-block", open },
    el("summary", {}, label, " ", button),
    el("pre", { class: "copy-text", "data-copy-text": label }, text));
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = el("textarea", { class: "offscreen" }, text); // http on a LAN address: no Clipboard API
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused");
}

function shellQuote(word) {
  return /^[\w.:\/=-]+$/.test(word) ? word : `'${String(word).replaceAll("'", "'\\''")}'`;
}

// The `tula` command that prints what the page shows: `tula show` for the stored plan, `tula plan` for a what-if.
export function cliCommand(jobId, whatIf, server) {
  const words = ["tula", whatIf ? "plan" : "show", jobId, "--server", server];
  if (whatIf) {
    const cluster = whatIf.cluster || {};
    const pricing = whatIf.pricing || {};
    const flags = [["--nodes", cluster.nodes], ["--gpus-per-node", cluster.gpus_per_node], ["--gpu-type", cluster.gpu_type],
      ["--pricing-kind", pricing.kind], ["--price", pricing.price], ["--objective", whatIf.objective],
      ["--deadline", whatIf.deadline_h !== undefined ? `${whatIf.deadline_h}h` : undefined], ["--budget", whatIf.budget_usd]];
    for (const [flag, value] of flags) if (value !== undefined && value !== null) words.push(flag, String(value));
  }
  return words.map(shellQuote).join(" ");
}

const TORCH_OPTIMIZERS = { sgd: "SGD", adam: "Adam", adamw: "AdamW", rmsprop: "RMSprop", nadam: "NAdam", radam: "RAdam", adamax: "Adamax", adagrad: "Adagrad", adafactor: "Adafactor" };

function pythonLiteral(value) {
  if (typeof value === "boolean") return value ? "True" : "False";
  if (Array.isArray(value)) return `(${value.map(pythonLiteral).join(", ")})`;
  return String(value);
}

// The torch.optim constructor with the settings the plan is for (lr_rule.optimizer_settings: spec or assumed).
export function optimizerLine(lr) {
  const settings = Object.entries(lr.optimizer_settings || {}).map(([name, setting]) => `, ${name}=${pythonLiteral(setting.value)}`);
  return `torch.optim.${TORCH_OPTIMIZERS[lr.optimizer]}(model.parameters(), lr=REFERENCE_LR * LR_MULTIPLIER${settings.join("")})`;
}

// A PyTorch snippet that applies this plan's AGS config with Tula's runtime (profiler/ags.py).
export function agsSnippet(rec, jobId) {
  const { delta, s } = rec.training_advice.ags;
  const lr = rec.training_advice.lr_rule;
  const chosen = rec.chosen;
  return `# AGS for Tula job ${jobId}: global batch ${chosen.global_batch} = ${chosen.device_batch} per device x ${chosen.devices} devices x ${chosen.accumulation} accumulation.
# On each optimizer step: variability v = |n_t - n_t-1| / n_t-1 of the gradient L2 norm n; if v < delta,
# the gradients (so the update) are scaled by s before the optimizer applies them.
from profiler.ags import AdaptiveGradientScaler  # Tula's runtime: pip install 'tula[worker]'

AGS_CONFIG = {
    "delta": ${delta.value},  # ${delta.source}: ${delta.why}
    "s": ${s.value},  # ${s.source}: ${s.why}
}
LR_MULTIPLIER = ${lr.multiplier.value}  # ${lr.multiplier.source}: ${lr.recommended} rule; multiply your reference LR by it

# optimizer = ${optimizerLine(lr)}
# optimizer = AdaptiveGradientScaler.wrap(optimizer, AGS_CONFIG)   # step() decides and scales first
# for inputs, targets in loader:
#     optimizer.zero_grad()
#     loss_fn(model(inputs), targets).backward()
#     optimizer.step()
# optimizer.ags.metrics()["scaled_fraction"]   # for your logger
`;
}

export function renderErrorTable(node, rec) {
  const memory = rec.models.memory;
  const compute = rec.models.compute;
  const row = (what, model, formula, loo, chosen) => [
    what, el("span", { title: formula }, model, chosen ? "" : " (not chosen)"),
    formatPercent(loo.median_rel_err, 2), formatPercent(loo.max_rel_err, 2), String(loo.points)];
  const rows = [row("memory", "line", memory.formula, memory.leave_one_out, true),
    row("iteration time", compute.name, compute.formula, compute.leave_one_out, true)];
  for (const [name, shape] of Object.entries(compute.selection.candidates || {})) {
    if (name !== compute.name && shape.eligible) rows.push(row("iteration time", name, shape.formula, shape.leave_one_out, false));
  }
  replaceChildren(node, table(["predicts", "model", "median error", "max error", "points"], rows));
  node.dataset.rows = String(rows.length);
}

export function renderRunnerUps(node, rec) {
  const signed = (pct) => (pct === null || pct === undefined ? "n/a" : `${pct > 0 ? "+" : ""}${significant(pct, 2)}%`);
  replaceChildren(node, table(["global batch", "per device × devices × accumulation", "time", "cost", "Δ time", "Δ cost"],
    rec.runner_ups.map((r) => [String(r.global_batch), `${r.device_batch} × ${r.devices} × ${r.accumulation}`,
      formatDuration(r.total_time_s), formatUsd(r.cost_usd), signed(r.time_delta_pct), signed(r.cost_delta_pct)])));
}

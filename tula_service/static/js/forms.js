// The API's field errors next to the form fields they name.
// A problem's errors carry dotted paths ("body.cluster.nodes", "body.batch_sizes.1"); each goes to the
// form's [data-error-for] slot of the longest matching prefix ("cluster.nodes", then "batch_sizes"),
// and what matches no field goes to the form-wide slot (data-error-for="") with its path.

import { el } from "./dom.js";

export function clearErrors(form) {
  for (const slot of form.querySelectorAll("[data-error-for]")) {
    slot.replaceChildren();
    if (slot.dataset.errorFor === "" && slot.classList.contains("form-error-box")) slot.hidden = true;
  }
  for (const field of form.querySelectorAll(".has-error")) field.classList.remove("has-error");
}

function slotFor(form, path, aliases) {
  const parts = path.split(".");
  while (parts.length) {
    const name = aliases[parts.join(".")] ?? parts.join(".");
    const slot = form.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
    if (slot) return slot;
    parts.pop();
  }
  return null;
}

function say(slot, text) {
  slot.append(el("span", { class: "message" }, text));
  slot.hidden = false;
  slot.closest("[data-field]")?.classList.add("has-error");
}

// aliases: API path -> slot name, for form fields that are not spec fields (e.g. "cluster.nodes" -> "cluster.devices")
export function showProblem(form, error, aliases = {}) {
  const general = form.querySelector('[data-error-for=""]');
  const errors = error.errors || [];
  if (!errors.length) {
    say(general, error.status ? `${error.message} (HTTP ${error.status})` : error.message);
    return;
  }
  for (const item of errors) {
    const path = item.field.replace(/^body\.?/, "");
    const slot = path ? slotFor(form, path, aliases) : null;
    if (slot) say(slot, item.message);
    else say(general, path ? `${path}: ${item.message}` : item.message);
  }
  for (const details of form.querySelectorAll("details")) {
    if (details.querySelector(".has-error, [data-error-for] .message")) details.open = true;
  }
  form.querySelector(".has-error input, .has-error select, .has-error textarea")?.focus();
}

export function showFieldError(form, name, message) {
  const slot = form.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
  say(slot, message);
}

// A number field: undefined when blank, the number when it parses, else the text (for the API to reject).
export function numberValue(input) {
  const text = input.value.trim();
  if (text === "") return undefined;
  const value = Number(text);
  return Number.isFinite(value) ? value : text;
}

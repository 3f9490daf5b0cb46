// The /v1 API from the browser. The API token lives in localStorage and goes out as a Bearer header;
// errors are application/problem+json (RFC 9457) and become ApiError with the problem's fields.

import { el, hideBanner, showBanner } from "./dom.js";

export const TOKEN_KEY = "tula.apiToken";

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
    this.errors = problem.errors || [];
  }
}

export function apiToken() {
  return localStorage.getItem(TOKEN_KEY) || "";
}

export function setApiToken(value) {
  if (value) localStorage.setItem(TOKEN_KEY, value);
  else localStorage.removeItem(TOKEN_KEY);
}

function unauthorized(error) {
  showBanner(
    el("span", {},
      el("strong", {}, "This server needs an API token. "),
      `${error.message}. `,
      apiToken()
        ? "The token saved in this browser was refused: paste a valid one under “API token” above."
        : "Paste one under “API token” above (an operator creates it with ",
      apiToken() ? "" : el("code", {}, "tula token create --name NAME"),
      apiToken() ? "" : ")."),
    "auth");
  const box = document.getElementById("token-box");
  if (box) box.open = true;
}

export async function api(path, { method = "GET", body, headers = {} } = {}) {
  const init = { method, headers: { Accept: "application/json, application/problem+json", ...headers } };
  const token = apiToken();
  if (token) init.headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    throw new ApiError(0, { title: "No answer", detail: `the server did not answer (${error.message})` });
  }
  const type = response.headers.get("content-type") || "";
  const payload = response.status === 204 ? null : type.includes("json") ? await response.json() : await response.text();
  if (!response.ok) {
    const problem = payload && typeof payload === "object" ? payload : { title: response.statusText, detail: String(payload) };
    const error = new ApiError(response.status, problem);
    if (response.status === 401) unauthorized(error);
    throw error;
  }
  hideBanner("auth");
  return payload;
}

// An Idempotency-Key: crypto.randomUUID exists in secure contexts only (https, localhost).
export function newIdempotencyKey() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

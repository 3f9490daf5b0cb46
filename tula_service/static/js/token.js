// The "API token" box in the header: saved in localStorage, sent by api.js as a Bearer token.

import { apiToken, setApiToken } from "./api.js";

const form = document.getElementById("token-form");
const input = document.getElementById("token-input");
const status = document.getElementById("token-status");

function describe() {
  status.textContent = apiToken()
    ? "A token is saved in this browser and sent with every API request."
    : "No token saved: requests go without one (fine while the server has no tokens).";
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  setApiToken(input.value.trim());
  input.value = "";
  describe();
  window.dispatchEvent(new CustomEvent("tula:token-changed"));
});

document.getElementById("token-forget").addEventListener("click", () => {
  setApiToken("");
  input.value = "";
  describe();
  window.dispatchEvent(new CustomEvent("tula:token-changed"));
});

describe();

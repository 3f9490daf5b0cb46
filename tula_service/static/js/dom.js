// Small DOM helpers: build elements without a framework, and the page-wide banner.

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
}

export function replaceChildren(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

export function table(headers, rows) {
  return [
    el("thead", {}, el("tr", {}, headers.map((header) => el("th", { scope: "col" }, header)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((cell) => el("td", {}, cell))))),
  ];
}

const banner = () => document.getElementById("banner");

// One banner per page; `kind` lets a later success clear only the message it resolves.
export function showBanner(message, kind = "error") {
  const node = banner();
  if (!node) return;
  node.dataset.kind = kind;
  replaceChildren(node, message);
  node.hidden = false;
}

export function hideBanner(kind) {
  const node = banner();
  if (node && (kind === undefined || node.dataset.kind === kind)) node.hidden = true;
}

// Small DOM and formatting helpers shared by the views. No framework: views build
// elements with h() and replace what changed.

/**
 * Create an element. attrs: "class", "text", "dataset" (object), "on" (events),
 * boolean attributes, anything else via setAttribute. Children: nodes, strings, arrays, null.
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "text") el.textContent = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name === "on") for (const [type, fn] of Object.entries(value)) el.addEventListener(type, fn);
    else if (name === "value") el.value = value;
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function fmtBytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  let value = Number(n);
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : value < 10 ? 2 : 1)} ${UNITS[unit]}`;
}

/** 1234 → "1.23k", 5.6e9 → "5.60G": for tokens/s and parameter counts. */
export function fmtCompact(n, digits = 3) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const abs = Math.abs(n);
  for (const [div, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (abs >= div) return `${(n / div).toPrecision(digits)}${suffix}`;
  }
  return abs >= 100 || Number.isInteger(n) ? String(Math.round(n)) : n.toPrecision(digits);
}

export function fmtNumber(n, digits = 4) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  if (n !== 0 && (Math.abs(n) < 1e-3 || Math.abs(n) >= 1e6)) return n.toExponential(2);
  return Number(n.toPrecision(digits)).toString();
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
  if (ms === 0) return "0 ms";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(ms < 10 ? 2 : 1)} ms`;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

/** Seconds since an ISO timestamp (the API's datetimes are UTC). */
export function secondsSince(iso, now = Date.now()) {
  if (!iso) return null;
  return (now - parseTime(iso)) / 1000;
}

export function parseTime(iso) {
  // A naive ISO string (no zone) from the API is UTC.
  const hasZone = /[zZ]|[+-]\d\d:?\d\d$/.test(iso);
  return Date.parse(hasZone ? iso : `${iso}Z`);
}

/** An estimated start (ISO or null) for people: "in 4m 10s", "any moment now", "unknown". */
export function fmtEta(iso, now = Date.now()) {
  if (!iso) return "unknown";
  const s = (parseTime(iso) - now) / 1000;
  return s <= 5 ? "any moment now" : `in ${fmtDuration(s)}`;
}

export function fmtAge(iso) {
  const s = secondsSince(iso);
  return s === null ? "–" : `${fmtDuration(s)} ago`;
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(parseTime(iso));
  return d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
}

export const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
export const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

export function statusBadge(status, extra = "") {
  return h("span", { class: `badge badge-${status}`, "data-testid": "job-status", text: `${status}${extra}` });
}

/** A progress bar with a text label (the label is what screen readers and tests read). */
export function progressBar(step, total) {
  const pct = total ? Math.min(100, (100 * step) / total) : null;
  const label = total ? `${step} / ${total}` : `${step} steps`;
  return h(
    "div",
    { class: "progress", "data-testid": "progress" },
    h("progress", { max: total || 1, value: total ? step : 0, "aria-label": `progress ${label}` }),
    h("span", { class: "progress-label", text: pct === null ? label : `${label} (${pct.toFixed(0)}%)` }),
  );
}

/** "2" for a job of 2 GPUs; "2 · box: 3, 5" while it holds GPUs 3 and 5 of host box. */
export function fmtGpus(job) {
  const held = job.held_gpus || [];
  const count = String(job.gpus ?? 1);
  if (!held.length) return count;
  const hosts = new Map();
  for (const g of held) {
    if (!hosts.has(g.worker)) hosts.set(g.worker, []);
    hosts.get(g.worker).push(g.device ?? `slot ${g.slot}`);
  }
  return `${count} · ${[...hosts].map(([host, ids]) => `${host}: ${ids.join(", ")}`).join("; ")}`;
}

export function jobTitle(job) {
  return job.name || job.id;
}

export function errorBox(err, testid = "error") {
  return h("div", { class: "error-box", role: "alert", "data-testid": testid, text: err?.message || String(err) });
}

/**
 * Run async ``fn`` now and every ``ms`` after it finishes (never two at once).
 * ``now()`` runs it again at once (or right after the run in progress); ``stop()`` ends it.
 */
export function poller(fn, ms) {
  let timer = 0;
  let busy = false;
  let again = false;
  let stopped = false;
  async function tick() {
    if (stopped) return;
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    clearTimeout(timer);
    try {
      await fn();
    } catch (err) {
      console.error(err);
    } finally {
      busy = false;
    }
    if (stopped) return;
    if (again) {
      again = false;
      tick();
    } else {
      timer = setTimeout(tick, ms);
    }
  }
  tick();
  return {
    now: tick,
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
    get stopped() {
      return stopped;
    },
  };
}

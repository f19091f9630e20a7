// Every request of the dashboard goes through api(): one place to add the
// `Authorization: Bearer <key>` header once users and API keys exist (the key
// would live in localStorage under KEY_STORAGE), and one shape for errors.

const KEY_STORAGE = "ftq.apiKey";

/** An API answer with a 4xx/5xx status, carrying the server's error envelope. */
export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.name = "ApiError";
    this.status = status;
    this.code = error?.code ?? "http_error";
    this.param = error?.param ?? null;
    this.line = error?.line ?? null;
    this.details = Array.isArray(error?.details) ? error.details : [];
  }
}

export function authHeaders() {
  let key = null;
  try {
    key = window.localStorage.getItem(KEY_STORAGE);
  } catch {
    // Storage can be disabled (privacy settings); then requests go without a key.
  }
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/**
 * Call the ftq API and return the parsed JSON body.
 *
 * @param {string} path   e.g. "/v1/jobs?status=running"
 * @param {object} opts   method, json (a body to send as JSON), body (FormData etc.), signal
 * @throws {ApiError}     for an error status (the server's message, param, line, details)
 * @throws {Error}        when the server cannot be reached
 */
export async function api(path, { method = "GET", json, body, signal, headers = {} } = {}) {
  const init = { method, signal, headers: { Accept: "application/json", ...authHeaders(), ...headers } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (body !== undefined) {
    init.body = body;
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    showReachable(false);
    throw new Error(`the ftq API is not reachable (${err.message})`);
  }
  showReachable(true);
  const text = await response.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
  }
  if (!response.ok) {
    throw new ApiError(response.status, data?.error ?? { message: text.slice(0, 300) || response.statusText });
  }
  return data;
}

/** The header's connection note: empty while the API answers. */
function showReachable(ok) {
  const el = document.querySelector("[data-testid=api-state]");
  if (el) el.textContent = ok ? "" : "API unreachable; retrying…";
}

/** Fetch every page of a cursor-paged list (``data`` + ``next_cursor``), up to ``max`` items. */
export async function apiAll(path, { max = 1000, signal } = {}) {
  const items = [];
  let cursor = null;
  const sep = path.includes("?") ? "&" : "?";
  do {
    const page = await api(`${path}${sep}limit=200${cursor ? `&after=${encodeURIComponent(cursor)}` : ""}`, { signal });
    items.push(...page.data);
    cursor = page.next_cursor;
  } while (cursor && items.length < max);
  return items;
}

/**
 * URL of a job's Server-Sent-Events stream starting after event ``after``.
 * EventSource cannot send headers: when API keys arrive, the stream needs a
 * cookie or a short-lived token in this URL; keep building it here.
 */
export function eventsUrl(jobId, after = 0) {
  return `/v1/jobs/${encodeURIComponent(jobId)}/events?after=${after}`;
}

// Every request of the dashboard goes through api(): one shape for errors, one
// place for authentication.
//
// Authentication is the HttpOnly session cookie set by POST /v1/session (see
// login()): page scripts never see the key, and nothing secret is kept in
// localStorage. The browser sends the cookie with fetch, EventSource and
// download links alike. Every request also carries X-Requested-With, which the
// API requires of cookie-authenticated requests that change something (CSRF).
// A 401 anywhere means the session ended (logged out, key revoked): the app
// shows the login view (event "ftq:unauthenticated").

const CSRF_HEADER = { "X-Requested-With": "ftq-dashboard" };
let me = null; // the logged-in user (GET /v1/users/me), cached for the session

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

/**
 * Call the ftq API and return the parsed JSON body.
 *
 * @param {string} path   e.g. "/v1/jobs?status=running"
 * @param {object} opts   method, json (a body to send as JSON), body (FormData etc.), signal
 * @throws {ApiError}     for an error status (the server's message, param, line, details)
 * @throws {Error}        when the server cannot be reached
 */
export async function api(path, { method = "GET", json, body, signal, headers = {} } = {}) {
  const init = { method, signal, headers: { Accept: "application/json", ...CSRF_HEADER, ...headers } };
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
  if (response.status === 401 && !path.startsWith("/v1/session")) {
    me = null;
    window.dispatchEvent(new CustomEvent("ftq:unauthenticated"));
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

/** Trade an API key for the session cookie; returns the user. */
export async function login(apiKey) {
  const session = await api("/v1/session", { method: "POST", json: { api_key: apiKey } });
  me = session.user;
  return me;
}

/** Drop the session cookie. */
export async function logout() {
  me = null;
  await api("/v1/session", { method: "DELETE" });
}

/** The logged-in user, or null when there is no valid session. */
export async function currentUser({ refresh = false } = {}) {
  if (me && !refresh) return me;
  try {
    me = await api("/v1/users/me");
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) return null;
    throw err;
  }
  return me;
}

const PROJECT_KEY = "ftq.project";

/**
 * The project the header's switcher selected, "" for all of the user's projects. The views list
 * its work only, and new jobs and uploads go to it ("": the user's default project on the box).
 * A name, not a secret: kept in localStorage.
 */
export function selectedProject() {
  return localStorage.getItem(PROJECT_KEY) || "";
}

export function selectProject(name) {
  if (name) localStorage.setItem(PROJECT_KEY, name);
  else localStorage.removeItem(PROJECT_KEY);
}

let adminOf = new Set(); // names of the projects the logged-in user is an admin of (from myProjects)

/** The projects the logged-in user is in (a global admin: all), with their role and the default. */
export async function myProjects() {
  const projects = (await api("/v1/projects")).data;
  adminOf = new Set(projects.filter((p) => p.role === "admin").map((p) => p.name));
  return projects;
}

/** May the logged-in user cancel or delete this job/file of `project`? Its owner, an admin of
 * its project or a global admin may (the server enforces it anyway). */
export function mayAct(owner, project) {
  return Boolean(me && (me.is_admin || me.name === owner || (project && adminOf.has(project))));
}

/**
 * URL of a job's Server-Sent-Events stream starting after event ``after``.
 * EventSource cannot send headers: the session cookie authenticates it.
 */
export function eventsUrl(jobId, after = 0) {
  return `/v1/jobs/${encodeURIComponent(jobId)}/events?after=${after}`;
}

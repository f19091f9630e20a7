// The dashboard's entry point: hash routing between the four views.
//
//   #/jobs[?status=running]   jobs list            (view-jobs.js)
//   #/jobs/<id>               one job, live        (view-job.js)
//   #/new                     submit a job         (view-new.js)
//   #/compare?ids=a,b         compare runs         (view-compare.js)
//   #/gpus                    workers and queue    (view-gpus.js)
//   #/playground[?job=<id>]   chat with 1-2 models (view-playground.js)
//   #/login[?next=#/...]      paste an API key     (view-login.js)
//
// Every view but login needs a session: without one (GET /v1/users/me is 401,
// or any request answers 401 later) the app goes to #/login and comes back
// to where it was after the login.
//
// The header's project switcher lists the user's projects (GET /v1/projects):
// the views then show that project's work only, and new jobs and uploads go
// to it; "All my projects" shows all of them and creates in the default one.
//
// A view is `render(main, params, query) -> cleanup`; the cleanup stops its
// timers and streams when the route changes.

import { renderJobs } from "./view-jobs.js";
import { renderJob } from "./view-job.js";
import { renderNew } from "./view-new.js";
import { renderCompare } from "./view-compare.js";
import { renderGpus } from "./view-gpus.js";
import { renderPlayground } from "./view-playground.js";
import { renderLogin } from "./view-login.js";
import { currentUser, logout, myProjects, selectProject, selectedProject } from "./api.js";
import { h, clear } from "./dom.js";

const ROUTES = [
  { pattern: /^\/jobs\/?$/, nav: "jobs", title: "Jobs", render: renderJobs },
  { pattern: /^\/jobs\/([^/]+)$/, nav: "jobs", title: "Job", render: renderJob },
  { pattern: /^\/new\/?$/, nav: "new", title: "New job", render: renderNew },
  { pattern: /^\/compare\/?$/, nav: "jobs", title: "Compare runs", render: renderCompare },
  { pattern: /^\/gpus\/?$/, nav: "gpus", title: "GPUs", render: renderGpus },
  { pattern: /^\/playground\/?$/, nav: "playground", title: "Playground", render: renderPlayground },
  { pattern: /^\/login\/?$/, nav: "login", title: "Log in", render: renderLogin, open: true },
];

let cleanup = null;

/** Split "#/jobs?status=running" into ["/jobs", URLSearchParams]. */
export function parseHash(hash) {
  const raw = hash.replace(/^#/, "") || "/jobs";
  const [path, query = ""] = raw.split("?", 2);
  return [path.startsWith("/") ? path : `/${path}`, new URLSearchParams(query)];
}

/** Show who is logged in (and the logout button) in the header. */
function showUser(user) {
  const slot = document.querySelector("[data-testid=whoami]");
  if (!slot) return;
  if (!user) {
    clear(slot);
    const projects = document.querySelector("[data-testid=project-switch]");
    if (projects) projects.hidden = true;
    return;
  }
  const out = h("button", { type: "button", class: "secondary small", "data-testid": "logout", text: "Log out" });
  out.addEventListener("click", async () => {
    try {
      await logout();
    } finally {
      showUser(null);
      window.location.hash = "#/login";
    }
  });
  clear(slot, h("span", { "data-testid": "whoami-name", text: user.is_admin ? `${user.name} (admin)` : user.name }), " ", out);
}

/**
 * Fill the project switcher with the user's projects; a stale selection (another user's) is
 * dropped. Resolves true when it dropped one (the view on screen was made for it). Not awaited
 * by route(): the view must replace the previous one at once, or what the old view shows (an
 * unfiltered list after a filter change) stands in for the new one while GET /v1/projects runs.
 */
async function showProjects(user) {
  const label = document.querySelector("[data-testid=project-switch]");
  const select = document.querySelector("[data-testid=project-switcher]");
  if (!label || !select) return false;
  if (!user) {
    label.hidden = true;
    return false;
  }
  let projects = [];
  try {
    projects = await myProjects();
  } catch {
    return false; // the view shows what is wrong with the API
  }
  const stale = Boolean(selectedProject()) && !projects.some((p) => p.name === selectedProject());
  if (stale) selectProject("");
  const fallback = projects.find((p) => p.default);
  select.replaceChildren(
    h("option", { value: "", text: `All my projects${fallback ? ` (new work: ${fallback.name})` : ""}` }),
    ...projects.map((p) => h("option", { value: p.name, text: p.role === "admin" ? `${p.name} (admin)` : p.name })),
  );
  select.value = selectedProject();
  label.hidden = false;
  return stale;
}

function toLogin() {
  const [path] = parseHash(window.location.hash);
  if (path.startsWith("/login")) return;
  showUser(null);
  window.location.hash = `#/login?next=${encodeURIComponent(window.location.hash || "#/jobs")}`;
}

async function route() {
  const [path0] = parseHash(window.location.hash);
  if (!path0.startsWith("/login")) {
    let user = null;
    try {
      user = await currentUser();
    } catch {
      user = { name: "?" }; // the API is unreachable: let the view show that
    }
    if (!user) return toLogin();
    showUser(user.name === "?" ? null : user);
    showProjects(user.name === "?" ? null : user).then((stale) => {
      if (stale) route(); // the view again, without the project the user is no longer in
    });
  }
  const main = document.getElementById("main");
  if (cleanup) {
    try {
      cleanup();
    } catch (err) {
      console.error("view cleanup failed", err);
    }
    cleanup = null;
  }
  const [path, query] = parseHash(window.location.hash);
  for (const r of ROUTES) {
    const match = path.match(r.pattern);
    if (!match) continue;
    document.querySelectorAll("[data-nav]").forEach((a) => {
      if (a.dataset.nav === r.nav) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    });
    document.title = `${r.title} · ftq`;
    clear(main);
    const params = match.slice(1).map(decodeURIComponent);
    cleanup = r.render(main, params, query) || null;
    return;
  }
  clear(
    main,
    h("h1", { text: "Page not found" }),
    h("p", {}, `Nothing lives at #${path}. `, h("a", { href: "#/jobs", text: "Go to the jobs list" }), "."),
  );
}

document.querySelector("[data-testid=project-switcher]")?.addEventListener("change", (event) => {
  selectProject(event.target.value);
  route(); // the current view again, in the selected project
});
window.addEventListener("hashchange", route);
window.addEventListener("ftq:unauthenticated", toLogin);
if (!window.location.hash) history.replaceState(null, "", "#/jobs");
route();

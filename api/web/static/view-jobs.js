// Jobs list: the jobs of the user's projects newest first (the header's switcher
// narrows it to one project; a global admin sees every project's), with their
// owner, filtered by status and owner, refreshed every few seconds.
//
// The list endpoint has no throughput, so for each running job the view asks
// /metrics for its latest step row (one small request per running job: a box
// runs at most one job per GPU). Finished jobs' last figures never change and
// are cached. The GPUs column shows a job's GPU count, and while it runs the
// GPUs it holds (host: CUDA ids). Loss is the last train loss, Best the lowest
// eval loss (train loss, marked, for a job without a validation set), from the
// job's summary.
//
// The search box filters by name, model or owner (GET /v1/jobs?q=, kept in the
// URL as ?q=). Ticking jobs and pressing Compare opens #/compare?ids=...
// (view-compare.js). At phone width each row is a card of label: value lines.

import { api, selectedProject } from "./api.js";
import { h, clear, fmtAge, fmtCompact, fmtGpus, progressBar, statusBadge, STATUSES, errorBox, jobTitle, poller } from "./dom.js";
import { MAX_COMPARED } from "./view-compare.js";

const POLL_MS = 3000;
const PAGE = 50;
const COLUMNS = ["Job", "Status", "Owner", "Model", "GPUs", "Progress", "Loss", "Best", "Tokens/s", "Worker", "Age"];

/** [final train loss, best loss, its tooltip] as text from a job's summary. */
export function losses(summary) {
  const fmt = (v) => (v === null || v === undefined ? "–" : v.toFixed(4));
  if (!summary) return ["–", "–", ""];
  if (summary.best_eval_loss !== null && summary.best_eval_loss !== undefined) {
    return [fmt(summary.final_train_loss), fmt(summary.best_eval_loss), `best eval loss (step ${summary.best_eval_step ?? "?"})`];
  }
  return [fmt(summary.final_train_loss), fmt(summary.best_train_loss) + (summary.best_train_loss != null ? " (train)" : ""), "best train loss: no validation set"];
}

export function renderJobs(main, _params, query) {
  const status = STATUSES.includes(query.get("status")) ? query.get("status") : "";
  const owner = query.get("owner") || "";
  let search = query.get("q") || "";
  const picked = new Set(); // job ids ticked for Compare
  let limit = PAGE;
  const lastRate = new Map(); // job id -> {step, tokens_per_s}
  const owners = new Set(owner && owner !== "me" ? [owner] : []); // names seen, for the owner filter

  function hashFor(next) {
    const qs = new URLSearchParams();
    if (next.status) qs.set("status", next.status);
    if (next.owner) qs.set("owner", next.owner);
    if (next.q) qs.set("q", next.q);
    return qs.toString() ? `#/jobs?${qs}` : "#/jobs";
  }
  function go(next) {
    window.location.hash = hashFor(next);
  }

  const filter = h(
    "select",
    {
      id: "status-filter",
      "data-testid": "status-filter",
      on: { change: () => go({ status: filter.value, owner, q: search }) },
    },
    h("option", { value: "", text: "All statuses" }),
    STATUSES.map((s) => h("option", { value: s, text: s, selected: s === status })),
  );
  const ownerFilter = h("select", {
    id: "owner-filter",
    "data-testid": "owner-filter",
    on: { change: () => go({ status, owner: ownerFilter.value, q: search }) },
  });
  const searchBox = h("input", { id: "job-search", type: "search", value: search, placeholder: "name, model or owner", "data-testid": "job-search" });
  let typing = 0;
  searchBox.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => {
      search = searchBox.value.trim();
      history.replaceState(null, "", hashFor({ status, owner, q: search })); // no re-render: the box keeps focus
      poll.now();
    }, 300);
  });
  const compare = h("button", { type: "button", class: "secondary", disabled: true, "data-testid": "compare-button", text: "Compare" });
  compare.addEventListener("click", () => {
    window.location.hash = `#/compare?ids=${[...picked].map(encodeURIComponent).join(",")}`;
  });
  function updateCompare() {
    compare.disabled = picked.size < 2;
    compare.textContent = picked.size ? `Compare (${picked.size})` : "Compare";
  }
  function fillOwners() {
    const options = [["", "Everyone"], ["me", "Mine"], ...[...owners].sort().map((o) => [o, o])];
    ownerFilter.replaceChildren(...options.map(([value, text]) => h("option", { value, text, selected: value === owner })));
  }
  fillOwners();
  const updated = h("span", { class: "muted", "data-testid": "jobs-updated", "aria-live": "off" });
  const body = h("tbody");
  const table = h(
    "table",
    { class: "jobs", "data-testid": "jobs-table" },
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        [h("th", { scope: "col" }, h("span", { class: "visually-hidden", text: "Pick" })), ...COLUMNS.map((t) => h("th", { scope: "col", text: t }))],
      ),
    ),
    body,
  );
  const more = h("button", { type: "button", class: "secondary", hidden: true, text: "Show older jobs" });
  more.addEventListener("click", () => {
    limit = Math.min(limit + PAGE, 200);
    poll.now();
  });
  const problem = h("div");

  clear(
    main,
    h(
      "div",
      { class: "view-head" },
      h("h1", { text: "Jobs" }),
      h("a", { class: "button", href: "#/new", "data-testid": "new-job-link", text: "New job" }),
    ),
    h(
      "div",
      { class: "toolbar wrap" },
      h("label", { for: "status-filter", text: "Status" }),
      filter,
      h("label", { for: "owner-filter", text: "Owner" }),
      ownerFilter,
      h("label", { for: "job-search", text: "Search" }),
      searchBox,
      compare,
      updated,
    ),
    problem,
    h("div", { class: "table-wrap" }, table),
    more,
  );

  async function latestRate(job) {
    const known = lastRate.get(job.id);
    if (job.progress.step === 0) return null;
    if (known && known.step === job.progress.step) return known.tokens_per_s;
    const page = await api(`/v1/jobs/${encodeURIComponent(job.id)}/metrics?after_step=${job.progress.step - 1}&limit=1`);
    const row = page.data[0];
    const rate = row ? row.tokens_per_s : null;
    lastRate.set(job.id, { step: job.progress.step, tokens_per_s: rate });
    return rate;
  }

  function pick(job) {
    const box = h("input", { type: "checkbox", checked: picked.has(job.id), "aria-label": `Compare ${jobTitle(job)}`, "data-testid": "job-pick" });
    box.addEventListener("change", () => {
      if (box.checked && picked.size >= MAX_COMPARED) box.checked = false;
      else if (box.checked) picked.add(job.id);
      else picked.delete(job.id);
      updateCompare();
    });
    return box;
  }

  function row(job, rate) {
    const [final, best, bestTitle] = losses(job.summary);
    const cell = (label, attrs, ...children) => h("td", { "data-label": label, ...attrs }, ...children);
    return h(
      "tr",
      { "data-testid": "job-row", "data-job-id": job.id, "data-status": job.status },
      h("td", { class: "pick" }, pick(job)),
      cell("Job", { class: "job-cell" }, h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) }), job.name ? h("div", { class: "muted mono", text: job.id }) : null),
      cell("Status", {}, statusBadge(job.status, job.cancel_requested && job.status === "running" ? " (cancelling)" : "")),
      cell("Owner", { "data-testid": "job-owner", text: job.owner || "–" }),
      cell("Model", { class: "mono", text: job.model }),
      cell("GPUs", { "data-testid": "job-gpus", "data-gpus": String(job.gpus ?? 1), text: fmtGpus(job) }),
      cell("Progress", {}, progressBar(job.progress.step, job.progress.total_steps)),
      cell("Loss", { class: "num", "data-testid": "job-loss", text: final }),
      cell("Best", { class: "num", "data-testid": "job-best-loss", title: bestTitle, text: best }),
      cell("Tokens/s", { class: "num", "data-testid": "job-tokens-per-s", text: rate === null || rate === undefined ? "–" : fmtCompact(rate) }),
      cell("Worker", { class: "mono", text: job.worker || "–" }),
      cell("Age", { title: job.created_at, text: fmtAge(job.created_at) }),
    );
  }

  async function refresh() {
    try {
      const qs = new URLSearchParams({ limit: String(limit) });
      if (status) qs.set("status", status);
      if (owner) qs.set("owner", owner);
      if (search) qs.set("q", search);
      if (selectedProject()) qs.set("project", selectedProject());
      const page = await api(`/v1/jobs?${qs}`);
      const before = owners.size;
      page.data.forEach((job) => job.owner && owners.add(job.owner));
      if (owners.size !== before) fillOwners();
      const rates = await Promise.all(
        page.data.map((job) => (job.progress.step > 0 ? latestRate(job).catch(() => null) : null)),
      );
      if (poll.stopped) return;
      const rows = page.data.map((job, i) => row(job, rates[i]));
      if (!rows.length) {
        const what = status || owner || search ? "No jobs match these filters." : "No jobs yet.";
        rows.push(h("tr", {}, h("td", { colspan: COLUMNS.length + 1, class: "empty" }, `${what} `, h("a", { href: "#/new", text: "Submit a job" }), ".")));
      }
      body.replaceChildren(...rows);
      more.hidden = !page.next_cursor || limit >= 200;
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
      clear(problem);
    } catch (err) {
      clear(problem, errorBox(err, "jobs-error"));
    }
  }

  const poll = poller(refresh, POLL_MS);
  return () => poll.stop();
}

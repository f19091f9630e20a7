// Jobs list: every job newest first (everyone on the box sees all of them, with
// their owner), filtered by status and owner, refreshed every few seconds.
//
// The list endpoint has no throughput, so for each running job the view asks
// /metrics for its latest step row (one small request per running job: a box
// runs at most one job per GPU). Finished jobs' last figures never change and
// are cached. The GPUs column shows a job's GPU count, and while it runs the
// GPUs it holds (host: CUDA ids).

import { api } from "./api.js";
import { h, clear, fmtAge, fmtCompact, fmtGpus, progressBar, statusBadge, STATUSES, errorBox, jobTitle, poller } from "./dom.js";

const POLL_MS = 3000;
const PAGE = 50;

export function renderJobs(main, _params, query) {
  const status = STATUSES.includes(query.get("status")) ? query.get("status") : "";
  const owner = query.get("owner") || "";
  let limit = PAGE;
  const lastRate = new Map(); // job id -> {step, tokens_per_s}
  const owners = new Set(owner && owner !== "me" ? [owner] : []); // names seen, for the owner filter

  function go(next) {
    const qs = new URLSearchParams();
    if (next.status) qs.set("status", next.status);
    if (next.owner) qs.set("owner", next.owner);
    window.location.hash = qs.toString() ? `#/jobs?${qs}` : "#/jobs";
  }

  const filter = h(
    "select",
    {
      id: "status-filter",
      "data-testid": "status-filter",
      on: { change: () => go({ status: filter.value, owner }) },
    },
    h("option", { value: "", text: "All statuses" }),
    STATUSES.map((s) => h("option", { value: s, text: s, selected: s === status })),
  );
  const ownerFilter = h("select", {
    id: "owner-filter",
    "data-testid": "owner-filter",
    on: { change: () => go({ status, owner: ownerFilter.value }) },
  });
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
        ["Job", "Status", "Owner", "Model", "GPUs", "Progress", "Tokens/s", "Worker", "Age"].map((t) => h("th", { scope: "col", text: t })),
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
      { class: "toolbar" },
      h("label", { for: "status-filter", text: "Status" }),
      filter,
      h("label", { for: "owner-filter", text: "Owner" }),
      ownerFilter,
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

  function row(job, rate) {
    return h(
      "tr",
      { "data-testid": "job-row", "data-job-id": job.id, "data-status": job.status },
      h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) }), job.name ? h("div", { class: "muted mono", text: job.id }) : null),
      h("td", {}, statusBadge(job.status, job.cancel_requested && job.status === "running" ? " (cancelling)" : "")),
      h("td", { "data-testid": "job-owner", text: job.owner || "–" }),
      h("td", { class: "mono", text: job.model }),
      h("td", { "data-testid": "job-gpus", "data-gpus": String(job.gpus ?? 1), text: fmtGpus(job) }),
      h("td", {}, progressBar(job.progress.step, job.progress.total_steps)),
      h("td", { class: "num", "data-testid": "job-tokens-per-s", text: rate === null || rate === undefined ? "–" : fmtCompact(rate) }),
      h("td", { class: "mono", text: job.worker || "–" }),
      h("td", { title: job.created_at, text: fmtAge(job.created_at) }),
    );
  }

  async function refresh() {
    try {
      const qs = new URLSearchParams({ limit: String(limit) });
      if (status) qs.set("status", status);
      if (owner) qs.set("owner", owner);
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
        const what = status || owner ? "No jobs match these filters." : "No jobs yet.";
        rows.push(h("tr", {}, h("td", { colspan: 9, class: "empty" }, `${what} `, h("a", { href: "#/new", text: "Submit a job" }), ".")));
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

// A training job's evals (its spec's `evals`, docs/evals.md): once the job has succeeded, each eval
// runs on the base and on the tuned model; this section shows each criterion's pass rate on both with
// the difference, and the items side by side (input, base output, tuned output, scores), filterable to
// the items whose status changed (GET /v1/jobs/{id}/evals).

import { api } from "./api.js";
import { h, clear, errorBox } from "./dom.js";

const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const signed = (x) => (x === null || x === undefined ? "–" : `${x >= 0 ? "+" : ""}${(100 * x).toFixed(1)} pts`);

/** The section for job ``id`` (URL-encoded); ``update(job)`` shows it for a job that names evals and reloads it. */
export function evalsSection(id, signal) {
  const body = h("div", { "data-testid": "job-evals-body" });
  const element = h(
    "section",
    { "aria-labelledby": "evals-h", "data-testid": "job-evals", hidden: true },
    h("h2", { id: "evals-h", text: "Evals: base vs tuned" }),
    body,
  );
  let loadedFor = null;

  async function load(job) {
    try {
      const answer = await api(`/v1/jobs/${id}/evals`, { signal });
      clear(body, answer.data.map(evalBlock));
      loadedFor = `${job.status}:${answer.data.map((e) => `${e.base?.status}/${e.tuned?.status}`).join(",")}`;
    } catch (err) {
      if (err.name !== "AbortError") clear(body, errorBox(err, "job-evals-error"));
    }
  }

  function update(job) {
    if (!job.spec?.evals?.length) return;
    element.hidden = false;
    if (job.status !== "succeeded") {
      clear(body, h("p", { class: "muted", text: "The evals run on the base and on the tuned model once the job has succeeded." }));
      return;
    }
    if (loadedFor === null || !loadedFor.endsWith("completed/completed")) load(job);
  }

  return { element, update, reload: load };
}

function evalBlock(ev) {
  const onlyChanged = h("input", { type: "checkbox", "data-testid": "evals-only-changed" });
  const items = h("div");
  const draw = () => clear(items, itemsTable(ev.items.filter((row) => !onlyChanged.checked || row.changed)));
  onlyChanged.addEventListener("change", draw);
  draw();
  const status = (side) => (ev[side] ? `${ev[side].status}, ${ev[side].result_counts.passed}/${ev[side].result_counts.total} passed` : "not started");
  return h(
    "div",
    { class: "eval-block", "data-testid": "job-eval", "data-eval": ev.eval_id },
    h("h3", { class: "mono", text: ev.eval_id }),
    h("p", { class: "muted", text: `base: ${status("base")} · tuned: ${status("tuned")}` }),
    h(
      "table",
      { class: "table", "data-testid": "eval-criteria" },
      h("thead", {}, h("tr", {}, ["Criterion", "Base", "Tuned", "Difference"].map((t) => h("th", { text: t })))),
      h("tbody", {}, ev.criteria.map((c) => h("tr", {},
        h("td", { text: c.name }), h("td", { text: pct(c.base) }), h("td", { text: pct(c.tuned) }),
        h("td", { "data-testid": "eval-difference", text: signed(c.difference) })))),
    ),
    h("label", {}, onlyChanged, " only the items whose status changed"),
    items,
  );
}

function itemsTable(rows) {
  const input = (row) => (row.input || []).map((m) => `${m.role}: ${m.content}`).join("\n");
  const side = (s) => (s ? `${s.output}\n[${s.status}: ${Object.entries(s.scores).map(([k, v]) => `${k} ${v}`).join(", ")}]` : "–");
  return h(
    "table",
    { class: "table", "data-testid": "eval-items" },
    h("thead", {}, h("tr", {}, ["#", "Input", "Base", "Tuned"].map((t) => h("th", { text: t })))),
    h("tbody", {}, rows.map((row) => h("tr", { "data-changed": String(row.changed) },
      h("td", { text: String(row.index) }), h("td", { class: "pre", text: input(row) }),
      h("td", { class: "pre", text: side(row.base) }), h("td", { class: "pre", text: side(row.tuned) })))),
  );
}

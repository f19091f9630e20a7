// A training job's evals (its spec's `evals`, docs/evals.md): once the job has succeeded, each eval
// runs on the base, on the tuned model and on the checkpoints it names; this section shows each
// criterion's pass rate and mean score on base and tuned with the difference, the pass rate per
// checkpoint (base as step 0, tuned as the final step), and the items side by side (input, base
// output, tuned output, scores), filterable to the items whose status changed (GET /v1/jobs/{id}/evals).

import { api } from "./api.js";
import { h, clear, errorBox } from "./dom.js";

const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const signed = (x) => (x === null || x === undefined ? "–" : `${x >= 0 ? "+" : ""}${(100 * x).toFixed(1)} pts`);
const num = (x) => (x === null || x === undefined ? "–" : x.toFixed(3));
const signedNum = (x) => (x === null || x === undefined ? "–" : `${x >= 0 ? "+" : ""}${x.toFixed(3)}`);

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
  let timer = null;

  async function load(job) {
    try {
      const answer = await api(`/v1/jobs/${id}/evals`, { signal });
      clear(body, answer.data.map(evalBlock));
      const statuses = (e) => [e.base?.status, e.tuned?.status, ...(e.checkpoints || []).map((c) => c.run.status)];
      loadedFor = answer.data.every((e) => statuses(e).every((s) => ["completed", "failed", "canceled"].includes(s)))
        ? "done" : "pending";
      // Runs queued after the job succeeded send the training job no events: poll while any is pending.
      clearTimeout(timer);
      if (loadedFor === "pending" && !signal?.aborted) timer = setTimeout(() => load(job), 3000);
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
    if (loadedFor !== "done") load(job);
  }

  return { element, update, reload: load };
}

function evalBlock(ev) {
  const onlyChanged = h("input", { type: "checkbox", "data-testid": "evals-only-changed" });
  const changed = ev.items.filter((row) => row.changed).length;
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
      h("thead", {}, h("tr", {}, ["Criterion", "Base", "Tuned", "Difference", "Mean score: base", "Mean score: tuned", "Mean score: difference"]
        .map((t) => h("th", { text: t })))),
      h("tbody", {}, ev.criteria.map((c) => h("tr", { "data-criterion": c.name },
        h("td", { text: c.name }), h("td", { "data-testid": "eval-base", text: pct(c.base) }),
        h("td", { "data-testid": "eval-tuned", text: pct(c.tuned) }),
        h("td", { "data-testid": "eval-difference", text: signed(c.difference) }),
        h("td", { text: num(c.base_mean_score) }), h("td", { text: num(c.tuned_mean_score) }),
        h("td", { text: signedNum(c.mean_score_difference) })))),
    ),
    checkpointsTable(ev),
    h("label", {}, onlyChanged, ` only the items whose status changed (${changed} of ${ev.items.length})`),
    items,
  );
}

// Pass rate per criterion at each step: the base (step 0), each checkpoint run, the tuned model.
function checkpointsTable(ev) {
  const checkpoints = ev.checkpoints || [];
  if (!checkpoints.length) return h("span");
  const names = ev.criteria.map((c) => c.name);
  const rate = (criteria, name) => pct((criteria || []).find((c) => c.name === name)?.pass_rate);
  const rows = [
    ["base (step 0)", "base", Object.fromEntries(ev.criteria.map((c) => [c.name, pct(c.base)]))],
    ...checkpoints.map((c) => [`step ${c.step} (${c.run.status})`, String(c.step),
      Object.fromEntries(names.map((n) => [n, rate(c.criteria, n)]))]),
    ["tuned (final)", "tuned", Object.fromEntries(ev.criteria.map((c) => [c.name, pct(c.tuned)]))],
  ];
  return h(
    "table",
    { class: "table", "data-testid": "eval-checkpoints" },
    h("caption", { text: "Pass rate per checkpoint" }),
    h("thead", {}, h("tr", {}, ["Model", ...names].map((t) => h("th", { text: t })))),
    h("tbody", {}, rows.map(([label, step, cells]) => h("tr", { "data-step": step },
      h("td", { text: label }), ...names.map((n) => h("td", { text: cells[n] }))))),
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

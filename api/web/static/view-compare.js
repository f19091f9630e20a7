// Compare runs: #/compare?ids=job-a,job-b,...
//
// One line per job on each chart: train loss, eval loss (GET /metrics' `eval`
// rows, where the job has a validation set), learning rate and gradient norm.
// Controls: x by optimizer step or by trained tokens (the running sum of each
// step's real tokens, so runs with other batch sizes line up by data seen);
// smoothing (an exponential moving average, debiased as TensorBoard's, 0 = raw);
// log scale (the charts plot log10 of the value and label the axis with the
// value itself). GRPO runs add their reward curves (each step's reward_mean)
// on a chart of their own. The eval scores table shows, per eval criterion, each
// job's pass rate on the base and the tuned model (GET /v1/jobs/{id}/evals, for
// the jobs whose spec names evals). A table of the jobs' hyperparameters marks
// the rows whose values differ. Each job's metrics are read once (paged), then
// the controls only redraw.

import { api } from "./api.js";
import { Chart } from "./charts.js";
import { h, clear, errorBox, fmtNumber, jobTitle, statusBadge } from "./dom.js";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d"];
export const MAX_COMPARED = 8;
const PAGE = 10000;
const METRICS = [
  ["loss", "Train loss", "chart-compare-loss"],
  ["eval_loss", "Eval loss", "chart-compare-eval"],
  ["lr", "Learning rate", "chart-compare-lr"],
  ["grad_norm", "Gradient norm", "chart-compare-grad"],
  ["reward_mean", "Reward (mean, GRPO)", "chart-compare-reward"],
];

export function renderCompare(main, _params, query) {
  const ids = (query.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean).slice(0, MAX_COMPARED);
  const controller = new AbortController();
  const state = { x: query.get("x") === "tokens" ? "tokens" : "step", smooth: Number(query.get("smooth") || 0), log: query.get("log") === "1" };
  const runs = []; // {job, color, rows, evals}
  const problem = h("div");
  const chartsBox = h("section", { class: "charts", "aria-label": "Compared charts" });
  const table = h("div", { "data-testid": "compare-params" });
  const evalScores = h("section", { "aria-labelledby": "compare-evals-h", "data-testid": "compare-evals", hidden: true });
  let charts = [];

  const xSelect = h("select", { id: "compare-x", "data-testid": "compare-x" }, h("option", { value: "step", text: "step" }), h("option", { value: "tokens", text: "tokens" }));
  xSelect.value = state.x;
  const smooth = h("input", { id: "compare-smooth", type: "range", min: "0", max: "0.99", step: "0.01", value: String(state.smooth), "data-testid": "compare-smooth" });
  const smoothLabel = h("output", { for: "compare-smooth", text: state.smooth.toFixed(2) });
  const log = h("input", { id: "compare-log", type: "checkbox", checked: state.log, "data-testid": "compare-log" });
  xSelect.addEventListener("change", () => { state.x = xSelect.value; redraw(); });
  smooth.addEventListener("input", () => { state.smooth = Number(smooth.value); smoothLabel.textContent = state.smooth.toFixed(2); redraw(); });
  log.addEventListener("change", () => { state.log = log.checked; redraw(); });

  clear(
    main,
    h("p", { class: "crumbs" }, h("a", { href: "#/jobs", text: "← Jobs" })),
    h("div", { class: "view-head" }, h("h1", { text: "Compare runs" })),
    h(
      "div",
      { class: "toolbar wrap" },
      h("label", { for: "compare-x", text: "x axis" }), xSelect,
      h("label", { for: "compare-smooth", text: "Smoothing" }), smooth, smoothLabel,
      h("span", { class: "radio" }, log, h("label", { for: "compare-log", text: "log scale" })),
    ),
    problem,
    chartsBox,
    evalScores,
    h("h2", { text: "Hyperparameters" }),
    table,
  );

  if (ids.length < 1) {
    clear(problem, h("p", {}, "Pick jobs to compare on the ", h("a", { href: "#/jobs", text: "jobs list" }), " (the checkboxes), then Compare."));
    return () => controller.abort();
  }

  function redraw() {
    charts.forEach((c) => c.destroy());
    charts = METRICS.map(([key, title, testid]) => {
      const chart = new Chart({
        title: state.log ? `${title} (log scale)` : title,
        testid,
        zero: false,
        format: state.log ? (v) => fmtNumber(10 ** v, 3) : (v) => fmtNumber(v, 3),
        series: runs.map((r) => ({ key: r.job.id, label: jobTitle(r.job), color: r.color })),
      });
      for (const r of runs) plot(chart, r, key);
      chart.canvas.dataset.x = state.x;
      if (state.x === "tokens") chart.setNote("x: tokens trained (the legend's step is the token count)");
      return chart;
    });
    const drawn = (key) => (key === "eval_loss" ? runs.some((r) => r.evals.length)
      : key === "reward_mean" ? runs.some((r) => r.rows.some((row) => typeof row.reward_mean === "number")) : true);
    clear(chartsBox, charts.filter((c, i) => drawn(METRICS[i][0])).map((c) => c.element));
  }

  function plot(chart, run, key) {
    const points = series(run, key, state.x);
    const values = ema(points.map(([, y]) => y), state.smooth);
    points.forEach(([x], i) => {
      const v = values[i];
      if (v === null || (state.log && !(v > 0))) return;
      chart.upsert(x, { [run.job.id]: state.log ? Math.log10(v) : v });
    });
  }

  load(ids, controller.signal)
    .then((loaded) => {
      loaded.forEach((r, i) => runs.push({ ...r, color: COLORS[i % COLORS.length] }));
      clear(table, paramsTable(runs));
      const scores = evalScoresTable(runs);
      evalScores.hidden = !scores;
      clear(evalScores, h("h2", { id: "compare-evals-h", text: "Eval scores: base → tuned" }), scores);
      redraw();
    })
    .catch((err) => {
      if (err.name !== "AbortError") clear(problem, errorBox(err, "compare-error"));
    });

  return () => {
    controller.abort();
    charts.forEach((c) => c.destroy());
  };
}

async function load(ids, signal) {
  return Promise.all(
    ids.map(async (id) => {
      const job = await api(`/v1/jobs/${encodeURIComponent(id)}`, { signal });
      const rows = [];
      let evals = [];
      let after = -1;
      for (;;) {
        const page = await api(`/v1/jobs/${encodeURIComponent(id)}/metrics?after_step=${after}&limit=${PAGE}`, { signal });
        rows.push(...page.data);
        if (page.eval) evals = page.eval;
        if (page.next_after_step === null || page.next_after_step === undefined) break;
        after = page.next_after_step;
      }
      const scores = job.spec?.evals?.length ? (await api(`/v1/jobs/${encodeURIComponent(id)}/evals`, { signal })).data : [];
      return { job, rows, evals, scores };
    }),
  );
}

/** One row per eval criterion of any compared job, a column per job: its pass rate on the base and on
 * the tuned model and the difference ("–" where the job has no such eval or it has not run). */
function evalScoresTable(runs) {
  const keys = [];
  for (const r of runs) {
    for (const ev of r.scores) {
      for (const c of ev.criteria) {
        const key = `${ev.eval_id} · ${c.name}`;
        if (!keys.includes(key)) keys.push(key);
      }
    }
  }
  if (!keys.length) return null;
  const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
  const cell = (run, key) => {
    const c = run.scores.flatMap((ev) => ev.criteria.map((c) => ({ key: `${ev.eval_id} · ${c.name}`, ...c }))).find((c) => c.key === key);
    if (!c) return h("td", { text: "–" });
    const diff = c.difference === null || c.difference === undefined ? "" : ` (${c.difference >= 0 ? "+" : ""}${(100 * c.difference).toFixed(1)} pts)`;
    return h("td", { class: "num", "data-testid": "compare-eval-score", "data-job": run.job.id, text: `${pct(c.base)} → ${pct(c.tuned)}${diff}` });
  };
  return h(
    "table",
    { class: "compare-table", "data-testid": "compare-evals-table" },
    h("thead", {}, h("tr", {}, h("th", { scope: "col", text: "Eval · criterion" }), runs.map((r) => h("th", { scope: "col" }, h("span", { class: "swatch", style: `background:${r.color}` }), jobTitle(r.job))))),
    h("tbody", {}, keys.map((key) => h("tr", { "data-testid": "compare-eval-row", "data-key": key }, h("th", { scope: "row", class: "mono", text: key }), runs.map((r) => cell(r, key))))),
  );
}

/** [x, y] pairs of ``key`` for a run; x is the step, or the tokens trained up to and including it. */
export function series(run, key, xBy) {
  const tokensAt = new Map();
  let total = 0;
  for (const row of run.rows) {
    total += row.tokens || 0;
    tokensAt.set(row.step, total);
  }
  const xOf = (step) => (xBy === "tokens" ? tokensAt.get(step) ?? null : step);
  const source = key === "eval_loss" ? run.evals.map((e) => ({ step: e.step, v: e.loss })) : run.rows.map((r) => ({ step: r.step, v: r[key] }));
  return source.filter((p) => p.v !== null && p.v !== undefined && xOf(p.step) !== null).map((p) => [xOf(p.step), p.v]);
}

/** Exponential moving average with TensorBoard's debiasing; ``weight`` 0 returns the values. */
export function ema(values, weight) {
  if (!weight) return values.slice();
  let last = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return null;
    n += 1;
    last = last * weight + (1 - weight) * v;
    return last / (1 - weight ** n);
  });
}

/** Flattened spec keys -> values per job; rows whose values differ are marked. */
function paramsTable(runs) {
  const flat = runs.map((r) => flatten({ model: r.job.model, method: r.job.method, training_file: r.job.training_file, ...r.job.spec }));
  const keys = [...new Set(flat.flatMap((f) => Object.keys(f)))].filter((k) => !["name"].includes(k)).sort();
  const differing = keys.filter((k) => new Set(flat.map((f) => JSON.stringify(f[k] ?? null))).size > 1);
  const summaryRow = (label, pick) =>
    h("tr", { class: "result" }, h("th", { scope: "row", text: label }), runs.map((r) => h("td", { class: "num", text: fmtLoss(pick(r.job.summary || {})) })));
  return h(
    "div",
    { class: "table-wrap" },
    h("p", { class: "help", "data-testid": "compare-differing", text: differing.length ? `${differing.length} ${differing.length > 1 ? "settings differ" : "setting differs"} (highlighted).` : "All settings are the same." }),
    h(
      "table",
      { class: "compare-table" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col", text: "Setting" }), runs.map((r) => h("th", { scope: "col" }, h("span", { class: "swatch", style: `background:${r.color}` }), h("a", { href: `#/jobs/${encodeURIComponent(r.job.id)}`, text: jobTitle(r.job) }), " ", statusBadge(r.job.status))))),
      h(
        "tbody",
        {},
        summaryRow("final train loss", (s) => s.final_train_loss),
        summaryRow("best eval loss", (s) => s.best_eval_loss),
        keys.map((k) =>
          h(
            "tr",
            { class: differing.includes(k) ? "differs" : "", "data-testid": "compare-param", "data-key": k, "data-differs": String(differing.includes(k)) },
            h("th", { scope: "row", class: "mono", text: k }),
            flat.map((f) => h("td", { class: "mono", text: f[k] === undefined ? "–" : JSON.stringify(f[k]) })),
          ),
        ),
      ),
    ),
  );
}

function fmtLoss(v) {
  return v === null || v === undefined ? "–" : v.toFixed(4);
}

function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, `${prefix}${k}.`, out);
    else out[`${prefix}${k}`] = v;
  }
  return out;
}

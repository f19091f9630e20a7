// One job, live: status and progress, its GPUs (count, and the ones it holds),
// charts of loss / tokens/s / step time (a mark on each step with CUDA allocator retries) / memory and of the job's objective's step fields (DPO's rewards and
// log-probs, SFT's token accuracy: the charts the API's schema lists, MetricOut's x-charts), per-rank step time and memory
// of a multi-GPU job (the latest step's `ranks`), the trainer's hardware plan,
// checkpoints, events and log, cancel; a banner for the trackers the worker could not run.
//
// No point lost, none drawn twice: on load the charts get the job's whole
// history from /metrics (paged), then the event stream is attached. The
// stream replays the job's events from the start (needed for the event and
// log list) and the charts skip any step already drawn; after that,
// EventSource reconnects on its own with Last-Event-ID, so a dropped
// connection resumes exactly after the last event received (an event whose id
// is not above the last one applied is counted in `data-duplicates` on the
// live indicator and ignored). The stream is closed on the job's final state
// event (otherwise EventSource would reconnect to a finished stream forever).

import { api, eventsUrl, mayAct } from "./api.js";
import { exportsSection } from "./view-job-exports.js";
import { evalsSection } from "./view-job-evals.js";
import { rolloutsSection } from "./view-job-rollouts.js";
import { generationSection } from "./view-job-generation.js";
import { jobResults } from "./view-job-results.js";
import { jobErrorBox, rerunActions } from "./view-job-reruns.js";
import { Chart } from "./charts.js";
import {
  h,
  clear,
  fmtBytes,
  fmtCompact,
  fmtDuration,
  fmtEta,
  fmtGpus,
  fmtMs,
  fmtNumber,
  fmtTime,
  progressBar,
  parseTime,
  statusBadge,
  errorBox,
  jobTitle,
  poller,
  FINISHED,
} from "./dom.js";

// Jobs that generate rather than train: a batch generation job and an eval run (docs/evals.md).
const GENERATING = new Set(["generate", "eval"]);

const MAX_EVENTS = 300;
const METRICS_PAGE = 1000;
// Plan decisions that always pick some backend (named with it, not listed as an optimization "on").
const ALWAYS_CHOSEN = new Set(["attention", "loss"]);
const COLORS = {
  loss: "#2563eb",
  eval: "#dc2626",
  rate: "#059669",
  data: "#94a3b8",
  forward: "#2563eb",
  backward: "#7c3aed",
  optimizer: "#f59e0b",
  other: "#cbd5e1",
  retries: "#dc2626",
  allocated: "#2563eb",
  reserved: "#7c3aed",
  peak: "#dc2626",
  rss: "#059669",
};
// The series of an objective's chart, in order (the objective names its fields, not their colours).
const SERIES_COLORS = ["#7c3aed", "#059669", "#2563eb", "#dc2626", "#f59e0b", "#0891b2"];
let objectiveChartList = null; // the objectives' charts read from /openapi.json (a promise), once per page load

/** [{objective, id, title, digits, series: [{key, label}]}]: MetricOut's x-charts in the API's schema. */
function loadObjectiveCharts() {
  if (!objectiveChartList) {
    objectiveChartList = api("/openapi.json").then((schema) => schema?.components?.schemas?.MetricOut?.["x-charts"] || []);
    objectiveChartList.catch(() => {
      objectiveChartList = null; // try again on the next job page
    });
  }
  return objectiveChartList;
}

export function renderJob(main, [jobId]) {
  const id = encodeURIComponent(jobId);
  const controller = new AbortController();
  const signal = controller.signal;
  let job = null;
  let lastStep = -1;
  let stream = null;
  let stopped = false;
  let lastSeq = 0; // id: of the last event applied; a reconnect resumes after it
  let opens = 0;
  let duplicates = 0;
  let refetchTimer = 0;
  const recent = []; // the last step rows, for the ETA and the summary

  const charts = {
    loss: new Chart({
      title: "Loss",
      testid: "chart-loss",
      zero: false,
      format: (v) => fmtNumber(v, 4),
      series: [
        { key: "loss", label: "train", color: COLORS.loss },
        { key: "eval_loss", label: "eval", color: COLORS.eval, dots: true },
      ],
    }),
    rate: new Chart({
      title: "Throughput (tokens/s)",
      testid: "chart-tokens",
      format: (v) => fmtCompact(v),
      series: [{ key: "tokens_per_s", label: "tokens/s", color: COLORS.rate }],
    }),
    time: new Chart({
      title: "Step time split",
      testid: "chart-step-time",
      stacked: true,
      format: (v) => fmtMs(v),
      series: [
        { key: "data_ms", label: "data", color: COLORS.data },
        { key: "forward_ms", label: "forward", color: COLORS.forward },
        { key: "backward_ms", label: "backward", color: COLORS.backward },
        { key: "optimizer_ms", label: "optimizer", color: COLORS.optimizer },
        { key: "other_ms", label: "other", color: COLORS.other },
      ],
      // A retry frees the allocator's cache and syncs the device: the step that stalled near the memory cap.
      marks: { key: "gpu_alloc_retries", label: "allocator retries", color: COLORS.retries },
    }),
    memory: new Chart({
      title: "Memory",
      testid: "chart-memory",
      format: (v) => fmtBytes(v),
      binary: true,
      series: [
        { key: "gpu_mem_allocated", label: "allocated", color: COLORS.allocated },
        { key: "gpu_mem_reserved", label: "reserved", color: COLORS.reserved },
        { key: "gpu_mem_peak", label: "peak", color: COLORS.peak },
        { key: "host_rss", label: "host RSS", color: COLORS.rss },
      ],
    }),
  };
  const objectiveCharts = []; // the job's objective's charts, added by addObjectiveCharts once the job is known

  // --- Skeleton -------------------------------------------------------------------------
  const chartSection = h("section", { class: "charts", "aria-label": "Training charts" }, Object.values(charts).map((c) => c.element));
  const title = h("h1", { "data-testid": "job-title", text: jobId });
  const badge = h("span", { class: "status-slot" });
  const live = h("span", { class: "live", "data-testid": "live-state", role: "status", "data-opens": "0", "data-duplicates": "0" });
  const meta = h("dl", { class: "meta", "data-testid": "job-meta" });
  const errorSlot = h("div");
  // A tracker the job asked for that the worker could not run (no package, server down): the job
  // goes on without it, and this says so where it is seen, not only in the event log.
  const trackingBanner = h("div", { class: "warning banner", role: "status", "data-testid": "job-tracking-warnings", hidden: true });
  const actions = h("div", { class: "actions", "data-testid": "job-actions" });
  const progress = h("div", { class: "progress-area", "data-testid": "job-progress" });
  const summary = h("dl", { class: "summary", "data-testid": "job-summary" });
  const results = jobResults(); // summary, preflight warnings, sample generations (view-job-results.js)
  const ranks = h("section", { "aria-labelledby": "ranks-h", "data-testid": "ranks", hidden: true });
  const plan = h("div", { "data-testid": "plan" }, h("p", { class: "muted", text: "The trainer reports its plan when the job starts." }));
  const checkpoints = h("div", { "data-testid": "checkpoints" });
  const exportsSlot = h("div"); // filled once the job has succeeded (view-job-exports.js)
  const generation = generationSection(id, signal, () => window.location.reload()); // a generation job's progress and completions
  generation.element.hidden = true;
  const evals = evalsSection(id, signal); // a training job's evals, base vs tuned (view-job-evals.js)
  const rollouts = rolloutsSection(id, signal); // a GRPO job's rollouts per step (view-job-rollouts.js)
  const eventList = h("ol", { class: "events", "data-testid": "event-log", "aria-live": "off" });
  const spec = h("pre", { class: "spec", "data-testid": "job-spec" });
  const problem = h("div");

  clear(
    main,
    h("p", { class: "crumbs" }, h("a", { href: "#/jobs", text: "← Jobs" })),
    h("div", { class: "view-head" }, h("div", { class: "title-line" }, title, badge, live), actions),
    problem,
    errorSlot,
    trackingBanner,
    meta,
    progress,
    summary,
    generation.element,
    results.element,
    evals.element,
    ranks,
    chartSection,
    rollouts.element,
    h("section", { "aria-labelledby": "plan-h", "data-training": "" }, h("h2", { id: "plan-h", text: "Hardware plan" }), plan),
    h("section", { "aria-labelledby": "ckpt-h", "data-training": "" }, h("h2", { id: "ckpt-h", text: "Checkpoints" }), checkpoints),
    exportsSlot,
    h("section", { "aria-labelledby": "events-h" }, h("h2", { id: "events-h", text: "Events and log" }), h("div", { class: "events-wrap" }, eventList)),
    h("details", { class: "spec-wrap" }, h("summary", { text: "Job spec (as submitted, defaults filled in)" }), spec),
  );

  // --- Rendering --------------------------------------------------------------------------
  function renderJobInfo() {
    title.textContent = jobTitle(job);
    results.setJob(job);
    const cancelling = job.cancel_requested && job.status === "running";
    clear(badge, statusBadge(job.status, cancelling ? " (cancelling)" : ""));
    main.dataset.status = job.status;
    const rows = [
      ["Job id", h("span", { class: "mono", text: job.id })],
      ["Owner", h("span", { "data-testid": "job-owner", text: job.owner || "–" })],
      ["Model", h("span", { class: "mono", text: job.model })],
      ["Method", job.spec?.objective === "dpo" ? `${job.method} · DPO (beta ${job.spec.dpo?.beta})` : job.method],
      ["GPUs", h("span", { "data-testid": "job-gpus", "data-gpus": String(job.gpus ?? 1), text: fmtGpus(job) })],
      [GENERATING.has(job.kind) ? "Prompts file" : "Training file", h("span", { class: "mono", text: job.training_file })],
      ["Worker", job.worker || "–"],
      ["Created", fmtTime(job.created_at)],
      ["Started", fmtTime(job.started_at)],
      ["Finished", fmtTime(job.finished_at)],
      ["Run time", job.started_at ? fmtDuration(((job.finished_at ? parseTime(job.finished_at) : Date.now()) - parseTime(job.started_at)) / 1000) : "–"],
    ];
    if (job.attempts > 1) rows.push(["Attempts", String(job.attempts)]);
    rows.splice(2, 0, ["Priority", h("span", { "data-testid": "job-priority", text: job.priority || "normal" })]);
    if (job.status === "queued" && job.queue) {
      const q = job.queue;
      rows.splice(3, 0, [
        "Queue",
        h(
          "span",
          { "data-testid": "job-queue", "data-position": String(q.position) },
          `position ${q.position} (${q.ahead.length} ahead) · estimated start `,
          h("span", { "data-testid": "job-queue-eta", title: q.decided_by ? "the cluster's scheduler starts it (its reason is in the events below once submitted)" : q.estimated_start_at ? fmtTime(q.estimated_start_at) : "no estimate yet: no live worker, or no pace to go by", text: q.decided_by || fmtEta(q.estimated_start_at) }),
          q.holds ? h("span", { "data-testid": "job-queue-holds", text: ` · first in line: the free GPUs of ${q.holds} wait for it` }) : null,
          q.waits_for ? h("span", { "data-testid": "job-queue-waits-for", text: ` · ${q.waits_for}` }) : null,
        ),
      ]);
    }
    clear(meta, rows.map(([k, v]) => h("div", {}, h("dt", { text: k }), h("dd", {}, v))));
    if (errorSlot.dataset.shown !== job.status) clear(errorSlot, job.error ? jobErrorBox(job) : null); // keep an open fold
    errorSlot.dataset.shown = job.status;
    spec.textContent = JSON.stringify(job.spec, null, 2);
    if (job.plan) renderPlan(job.plan);
    renderActions();
    renderProgress();
    if (!GENERATING.has(job.kind)) evals.update(job);
    if (!GENERATING.has(job.kind)) rollouts.update(job);
    if (GENERATING.has(job.kind)) { // no steps, plan or checkpoints: prompts, tokens/s and completions
      generation.element.hidden = false;
      for (const el of [progress, summary, chartSection, ...main.querySelectorAll("[data-training]")]) el.hidden = true;
      generation.update(job);
    }
  }

  function renderProgress() {
    const step = Math.max(job.progress.step, lastStep, 0);
    const total = job.progress.total_steps;
    const last = recent[recent.length - 1];
    let eta = null;
    if (job.status === "running" && total && recent.length) {
      const ms = recent.reduce((a, r) => a + (r.step_ms || 0), 0) / recent.length;
      eta = ((total - step) * ms) / 1000;
    }
    clear(progress, progressBar(step, total), eta !== null ? h("span", { class: "muted", text: `about ${fmtDuration(eta)} left` }) : null);
    const items = [
      ["Loss", last ? fmtNumber(last.loss, 4) : "–"],
      ["Tokens/s", last ? fmtCompact(last.tokens_per_s) : "–"],
      ["Step time", last ? fmtMs(last.step_ms) : "–"],
      ["Learning rate", last ? fmtNumber(last.lr, 3) : "–"],
      ["Grad norm", last ? fmtNumber(last.grad_norm, 3) : "–"],
      ["MFU", last && last.mfu !== null && last.mfu !== undefined ? `${(100 * last.mfu).toFixed(1)}%` : "–"],
    ];
    clear(summary, items.map(([k, v]) => h("div", {}, h("dt", { text: k }), h("dd", { "data-testid": `summary-${k.toLowerCase().replace(/[^a-z]+/g, "-")}`, text: v }))));
    renderRanks(last);
  }

  // A multi-GPU job's latest step, rank by rank: rank r runs on the r-th GPU the job holds.
  function renderRanks(last) {
    const perRank = last && Array.isArray(last.ranks) ? last.ranks : null;
    ranks.hidden = !perRank;
    if (!perRank) return;
    const held = job.held_gpus || [];
    const slowest = Math.max(...perRank.map((r) => r.step_ms ?? 0));
    const memory = (r) => (r.gpu_mem_peak ?? null) !== null ? fmtBytes(r.gpu_mem_peak) : r.host_rss ? `${fmtBytes(r.host_rss)} (host RSS)` : "–";
    clear(
      ranks,
      h("h2", { id: "ranks-h", text: `Ranks (step ${last.step})` }),
      h(
        "table",
        { class: "ranks-table", "data-testid": "rank-table" },
        h("thead", {}, h("tr", {}, ["Rank", "GPU", "Step time", "Data", "Forward", "Backward", "Optimizer", "Tokens", "Memory (peak)", "Allocator retries"].map((t) => h("th", { scope: "col", text: t })))),
        h(
          "tbody",
          {},
          perRank.map((r) => {
            const gpu = held[r.rank];
            return h(
              "tr",
              { "data-testid": "rank-row", "data-rank": String(r.rank), class: r.step_ms === slowest && perRank.length > 1 ? "slowest" : "" },
              h("th", { scope: "row", class: "num", text: String(r.rank) }),
              h("td", { class: "mono", text: gpu ? `${gpu.worker}: ${gpu.device ?? `slot ${gpu.slot}`}` : "–" }),
              h("td", { class: "num", "data-testid": "rank-step-ms", text: fmtMs(r.step_ms) }),
              h("td", { class: "num", text: fmtMs(r.data_ms) }),
              h("td", { class: "num", text: fmtMs(r.forward_ms) }),
              h("td", { class: "num", text: fmtMs(r.backward_ms) }),
              h("td", { class: "num", text: fmtMs(r.optimizer_ms) }),
              h("td", { class: "num", "data-testid": "rank-tokens", text: fmtCompact(r.tokens) }),
              h("td", { class: "num", "data-testid": "rank-memory", text: memory(r) }),
              h("td", { class: "num", "data-testid": "rank-alloc-retries", text: String(r.gpu_alloc_retries ?? "–") }),
            );
          }),
        ),
      ),
      h("p", { class: "muted", text: "The step waits for its slowest rank (highlighted); the charts show the job: tokens summed over the ranks, the slowest rank's times, the largest memory, the allocator retries summed." }),
    );
  }

  let reruns = null;
  function renderActions() {
    const nodes = [];
    if (job.status === "succeeded" && !GENERATING.has(job.kind)) {
      nodes.push(h("a", { class: "button", href: `/v1/jobs/${id}/adapter`, download: "", "data-testid": "download-adapter", text: "Download adapter (.zip)" }));
      nodes.push(h("a", { class: "button secondary", href: `#/playground?job=${id}`, "data-testid": "try-it", text: "Try it" }));
      if (!exportsSlot.firstChild) clear(exportsSlot, exportsSection(id, signal));
    }
    // Only the owner or an admin may cancel (the API answers 403 to anyone else anyway).
    if (!FINISHED.has(job.status) && mayAct(job.owner, job.project)) {
      const confirmBox = h(
        "div",
        { class: "confirm", hidden: true, role: "group", "aria-label": "Confirm cancel" },
        h("span", { text: job.status === "running" ? "Stop this job? It writes a checkpoint, then exits." : "Remove this job from the queue?" }),
        h("button", { type: "button", class: "danger", "data-testid": "confirm-cancel", on: { click: doCancel }, text: "Yes, cancel it" }),
        h("button", { type: "button", class: "secondary", on: { click: () => { confirmBox.hidden = true; cancelBtn.hidden = false; cancelBtn.focus(); } }, text: "Keep it" }),
      );
      const cancelBtn = h("button", {
        type: "button",
        class: "danger",
        "data-testid": "cancel-job",
        disabled: job.cancel_requested,
        text: job.cancel_requested ? "Cancelling…" : "Cancel job",
        on: { click: () => { cancelBtn.hidden = true; confirmBox.hidden = false; confirmBox.querySelector("button").focus(); } },
      });
      nodes.push(cancelBtn, confirmBox);
    }
    if (FINISHED.has(job.status) && !GENERATING.has(job.kind) && actions.dataset.reruns !== job.status) {
      actions.dataset.reruns = job.status; // once per final state: re-rendering would close an open form
      reruns = rerunActions(job, signal);
    }
    clear(actions, nodes, FINISHED.has(job.status) && !GENERATING.has(job.kind) ? reruns : null);
  }

  async function doCancel() {
    try {
      job = await api(`/v1/jobs/${id}/cancel`, { method: "POST", signal });
      renderJobInfo();
    } catch (err) {
      if (err.name !== "AbortError") clear(problem, errorBox(err, "cancel-error"));
    }
  }

  function renderPlan(p) {
    const hw = p.hardware || {};
    const decisions = p.decisions || []; // kernel choices, then the switches: {name, requested, enabled, backend, reason}
    const model = p.model || {};
    const facts = [
      ["Device", `${hw.name || p.device || "?"} (${hw.device || p.device || "?"}${hw.capability ? `, sm${hw.capability.join("")}` : ""})`],
      ["GPU memory", hw.gpu_memory ? fmtBytes(hw.gpu_memory) : "– (CPU)"],
      ["Compute dtype", p.dtype || "–"],
      // The trainer counts the adapter's weights in params; the form and the models list show the base alone.
      ["Parameters", !model.params ? "–" : model.trainable_params < model.params
        ? `${fmtCompact(model.params - model.trainable_params)} base + ${fmtCompact(model.trainable_params)} trainable adapter`
        : `${fmtCompact(model.params)} (all trainable)`],
      ["Layers", model.layers ?? "–"],
      ["Torch", `${hw.torch_version || "?"}${hw.cuda_version ? ` / CUDA ${hw.cuda_version}` : ""}`],
    ];
    const parallel = decisions.find((d) => d.name === "parallelism");
    if ((p.world_size ?? 1) > 1 || parallel?.enabled) {
      const how = [parallel?.backend, hw.interconnect].filter(Boolean).join(", ");
      facts.splice(1, 0, ["Ranks", `${p.world_size ?? "?"}${how ? ` (${how})` : ""}`]);
    }
    if (p.resumed_from_step !== null && p.resumed_from_step !== undefined) facts.push(["Resumed from", `step ${p.resumed_from_step}`]);
    clear(
      plan,
      h("dl", { class: "meta compact" }, facts.map(([k, v]) => h("div", {}, h("dt", { text: k }), h("dd", { text: String(v) })))),
      h(
        "table",
        { class: "plan", "data-testid": "plan-table" },
        h("thead", {}, h("tr", {}, ["Optimization", "Requested", "Enabled", "Backend", "Reason"].map((t) => h("th", { scope: "col", text: t })))),
        h(
          "tbody",
          {},
          decisions.map((d) =>
            h(
              "tr",
              { "data-testid": "plan-row", "data-name": d.name, "data-enabled": String(Boolean(d.enabled)) },
              h("th", { scope: "row", class: "mono", text: d.name }),
              h("td", { text: d.requested || "–" }),
              h("td", {}, h("span", { class: `pill ${d.enabled ? "on" : "off"}`, text: d.enabled ? "on" : "off" })),
              h("td", { class: "mono", text: d.backend || "–" }),
              h("td", { text: d.reason || "" }),
            ),
          ),
        ),
      ),
    );
    updateMemoryCapacity();
  }

  function updateMemoryCapacity() {
    const capacity = job?.plan?.hardware?.gpu_memory;
    const gpu = charts.memory.has("gpu_mem_allocated") || charts.memory.has("gpu_mem_reserved");
    if (gpu && capacity) {
      charts.memory.setCapacity(capacity, `GPU capacity ${fmtBytes(capacity)}`);
      charts.memory.setNote("");
    } else {
      charts.memory.setCapacity(null);
      charts.memory.setNote(!gpu && charts.memory.has("host_rss") ? "No GPU memory to show: the job runs on the CPU, so this is the trainer's host RSS." : "");
    }
  }

  async function renderCheckpoints() {
    const list = await api(`/v1/jobs/${id}/checkpoints`, { signal });
    if (!list.data.length) {
      clear(checkpoints, h("p", { class: "muted", text: job && job.spec.checkpoint_every ? `Every ${job.spec.checkpoint_every} steps, and at the end.` : "Written at the end of the run." }));
      return;
    }
    clear(
      checkpoints,
      h(
        "table",
        { class: "checkpoints-table", "data-testid": "checkpoint-table" },
        h("thead", {}, h("tr", {}, ["Step", "Size", "Written", ""].map((t) => h("th", { scope: "col", text: t })))),
        h(
          "tbody",
          {},
          list.data.map((c) =>
            h(
              "tr",
              { "data-testid": "checkpoint-row", "data-step": String(c.step) },
              h("td", { class: "num", text: `${c.step}${c.final ? " (final)" : ""}` }),
              h("td", { class: "num", text: fmtBytes(c.bytes) }),
              h("td", { text: fmtTime(c.created_at) }),
              h("td", {}, h("a", { href: `/v1/jobs/${id}/checkpoints/${c.step}/download`, download: "", "data-testid": "download-checkpoint", text: "Download" })),
            ),
          ),
        ),
      ),
    );
  }

  // --- Data -----------------------------------------------------------------------------
  function addStep(row) {
    if (row.step <= lastStep) return false;
    lastStep = row.step;
    const parts = (row.data_ms || 0) + (row.forward_ms || 0) + (row.backward_ms || 0) + (row.optimizer_ms || 0);
    const other = row.step_ms !== null && row.step_ms !== undefined ? Math.max(row.step_ms - parts, 0) : null;
    charts.loss.upsert(row.step, row);
    charts.rate.upsert(row.step, row);
    charts.time.upsert(row.step, { ...row, other_ms: other });
    charts.memory.upsert(row.step, row);
    for (const chart of objectiveCharts) chart.upsert(row.step, row);
    recent.push(row);
    if (recent.length > 20) recent.shift();
    return true;
  }

  async function addObjectiveCharts() {
    if (objectiveCharts.length) return;
    const objective = job.spec?.objective; // stored with its default filled in
    for (const c of (await loadObjectiveCharts()).filter((c) => c.objective === objective)) {
      const chart = new Chart({
        title: c.title,
        testid: `chart-${c.id}`,
        zero: false,
        format: (v) => fmtNumber(v, c.digits),
        series: c.series.map((s, i) => ({ key: s.key, label: s.label, color: SERIES_COLORS[i % SERIES_COLORS.length] })),
      });
      objectiveCharts.push(chart);
      chartSection.append(chart.element);
    }
  }

  async function loadHistory() {
    let after = -1;
    for (;;) {
      const page = await api(`/v1/jobs/${id}/metrics?after_step=${after}&limit=${METRICS_PAGE}`, { signal });
      page.data.forEach(addStep);
      for (const e of page.eval || []) if (typeof e.loss === "number") charts.loss.upsert(e.step, { eval_loss: e.loss });
      if (page.next_after_step === null || page.next_after_step === undefined) break;
      after = page.next_after_step;
    }
    updateMemoryCapacity();
  }

  function logEvent(type, data, seq) {
    const when = typeof data.time === "number" ? new Date(data.time * 1000).toLocaleTimeString() : "";
    const li = h("li", { class: `event event-${type}${data.level ? ` level-${data.level}` : ""}`, "data-type": type, "data-seq": String(seq) },
      h("span", { class: "event-time", text: when }),
      h("span", { class: "event-type", text: type }),
      h("span", { class: "event-text", text: describeEvent(type, data) }),
    );
    const nearBottom = eventList.parentElement.scrollHeight - eventList.parentElement.scrollTop - eventList.parentElement.clientHeight < 40;
    eventList.append(li);
    while (eventList.childElementCount > MAX_EVENTS) eventList.firstElementChild.remove();
    if (nearBottom) eventList.parentElement.scrollTop = eventList.parentElement.scrollHeight;
  }

  function showTrackingWarning(message) {
    if (trackingBanner.hidden) trackingBanner.append(h("strong", { text: "Experiment tracking" }));
    trackingBanner.append(h("p", { "data-testid": "job-tracking-warning", text: message ?? "" }));
    trackingBanner.hidden = false;
  }

  function scheduleRefetch(delay = 300) {
    clearTimeout(refetchTimer);
    refetchTimer = setTimeout(async () => {
      try {
        job = await api(`/v1/jobs/${id}`, { signal });
        renderJobInfo();
        await renderCheckpoints();
      } catch (err) {
        if (err.name !== "AbortError") clear(problem, errorBox(err));
      }
    }, delay);
  }

  function onEvent(type, message) {
    let data;
    try {
      data = JSON.parse(message.data);
    } catch {
      return;
    }
    const seq = Number(message.lastEventId) || 0;
    if (seq && seq <= lastSeq) {
      // The server resumes after Last-Event-ID, so this should not happen; never apply twice.
      duplicates += 1;
      live.dataset.duplicates = String(duplicates);
      return;
    }
    if (seq) lastSeq = seq;
    if (type === "step") {
      if (addStep(data)) {
        if (data.total_steps) job.progress.total_steps = data.total_steps;
        job.progress.step = Math.max(job.progress.step, data.step);
        renderProgress();
        if (charts.memory.points === 1) updateMemoryCapacity();
      }
      return;
    }
    if (type === "rollouts") { // one a step, as steps: shown in its section, not in the log
      rollouts.add(data);
      return;
    }
    logEvent(type, data, seq);
    if (type === "log" && data.level === "warning" && data.source === "tracking") showTrackingWarning(data.message);
    if (type === "eval" && typeof data.loss === "number") charts.loss.upsert(data.step, { eval_loss: data.loss });
    if (type === "sample") results.addSample(data);
    if (type === "progress" && GENERATING.has(job.kind)) generation.update(job, data);
    if (type === "plan") {
      job.plan = data;
      if (data.total_steps) job.progress.total_steps = data.total_steps;
      renderPlan(data);
      renderProgress();
    }
    if (type === "checkpoint") scheduleRefetch();
    if (type === "state") {
      job.status = data.status;
      clear(badge, statusBadge(job.status));
      if (FINISHED.has(data.status) && !data.paused) {  // a paused stop was resumed: more follows
        closeStream("finished");
        scheduleRefetch(0);
      } else {
        scheduleRefetch();
      }
    }
  }

  function openStream() {
    if (stopped) return;
    const source = new EventSource(eventsUrl(jobId, 0));
    stream = source;
    live.textContent = "connecting…";
    source.onopen = () => {
      opens += 1;
      live.dataset.opens = String(opens);
      live.textContent = "● live";
      live.dataset.state = "live";
    };
    source.onerror = () => {
      if (stream !== source) return;
      if (source.readyState === EventSource.CLOSED) {
        live.textContent = "live updates stopped; reload the page";
        live.dataset.state = "closed";
      } else {
        live.textContent = "reconnecting…";
        live.dataset.state = "reconnecting";
      }
    };
    for (const type of ["state", "plan", "step", "log", "checkpoint", "eval", "skip", "sample", "progress", "rollouts"]) {
      source.addEventListener(type, (message) => onEvent(type, message));
    }
  }

  function closeStream(reason) {
    if (stream) stream.close();
    stream = null;
    live.textContent = reason === "finished" ? "" : reason;
    live.dataset.state = reason;
  }

  async function load() {
    try {
      job = await api(`/v1/jobs/${id}`, { signal });
      renderJobInfo();
      await addObjectiveCharts();
      await loadHistory();
      renderProgress();
      await renderCheckpoints();
      main.dataset.historyLoaded = "true";
      openStream();
    } catch (err) {
      if (err.name === "AbortError") return;
      clear(problem, errorBox(err, "job-load-error"));
    }
  }

  // While the job waits, its position and start estimate move as other jobs start and end.
  const queuePoll = poller(async () => {
    if (!job || job.status !== "queued") return;
    const fresh = await api(`/v1/jobs/${id}`, { signal });
    if (job.status === "queued" && fresh.status === "queued") {
      job.queue = fresh.queue;
      renderJobInfo();
    }
  }, 5000);

  load();
  return () => {
    stopped = true;
    queuePoll.stop();
    controller.abort();
    clearTimeout(refetchTimer);
    if (stream) stream.close();
    Object.values(charts).forEach((c) => c.destroy());
    delete main.dataset.status;
    delete main.dataset.historyLoaded;
  };
}

function describeEvent(type, d) {
  switch (type) {
    case "state": {
      const extra = Object.entries(d).filter(([k, v]) => !["status", "time"].includes(k) && v !== null && v !== undefined).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`);
      return `→ ${d.status}${extra.length ? ` (${extra.join(", ")})` : ""}`;
    }
    case "plan": {
      const decisions = d.decisions || [];
      const attention = decisions.find((x) => x.name === "attention");
      const on = decisions.filter((x) => x.enabled && !ALWAYS_CHOSEN.has(x.name)).map((x) => x.name);
      return `${d.hardware?.name || d.device} · ${d.dtype || ""} · attention ${attention?.backend || "?"} · ${on.length ? `on: ${on.join(", ")}` : "no optimizations on"} · ${d.total_steps ?? "?"} steps`;
    }
    case "log":
      return `[${d.level || "info"}] ${d.message ?? ""}`;
    case "checkpoint":
      return `step ${d.step}${d.final ? " (final)" : ""}, ${fmtBytes(d.bytes)}`;
    case "eval":
      return `step ${d.step}: eval loss ${fmtNumber(d.loss, 4)} over ${d.tokens ?? "?"} tokens`;
    case "skip":
      return `step ${d.step} not applied: loss ${d.loss ?? "NaN/inf"}, grad norm ${d.grad_norm ?? "NaN/inf"} (${d.consecutive} in a row of at most ${d.limit})`;
    case "sample":
      return `step ${d.step}: ${(d.samples || []).length} sample generations${d.final ? " (final)" : ""}`;
    case "progress":
      return `${d.prompts_done} / ${d.prompts_total} prompts${d.tokens_per_s ? ` · ${fmtCompact(d.tokens_per_s)} tokens/s` : ""}`;
    default:
      return JSON.stringify(d);
  }
}

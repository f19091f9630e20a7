// GPUs: every worker of the box (one per GPU) with its device, liveness,
// current job and that job's memory against the card's capacity; then the
// queue, oldest first, with each waiting job's position.
//
// Queue order is submission order: workers claim the oldest queued job first.

import { api, apiAll } from "./api.js";
import { h, clear, fmtAge, fmtBytes, fmtCompact, fmtDuration, jobTitle, progressBar, errorBox, poller, parseTime, statusBadge } from "./dom.js";

const POLL_MS = 3000;

export function renderGpus(main) {
  const workersEl = h("div", { class: "cards", "data-testid": "workers" });
  const queueEl = h("div", { "data-testid": "queue" });
  const problem = h("div");
  const updated = h("span", { class: "muted", "data-testid": "gpus-updated" });
  clear(
    main,
    h("div", { class: "view-head" }, h("h1", { text: "GPUs" }), updated),
    problem,
    h("section", { "aria-labelledby": "workers-h" }, h("h2", { id: "workers-h", text: "Workers" }), workersEl),
    h("section", { "aria-labelledby": "queue-h" }, h("h2", { id: "queue-h", text: "Queue" }), queueEl),
  );

  async function currentJob(jobId) {
    const job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
    let metric = null;
    if (job.progress.step > 0) {
      const page = await api(`/v1/jobs/${encodeURIComponent(jobId)}/metrics?after_step=${job.progress.step - 1}&limit=1`);
      metric = page.data[0] || null;
    }
    return { job, metric };
  }

  function workerCard(worker, current) {
    const report = worker.hardware || {};
    const hw = report.hardware || report;
    const capacity = hw.gpu_memory || null;
    const plan = worker.plan || report.plan || null;
    const decisions = Array.isArray(plan) ? plan : plan?.decisions || [];
    const enabled = decisions.filter((d) => d.enabled).map((d) => d.name);
    const heading = `${worker.device}${hw.name ? ` · ${hw.name}` : ""}`;
    const body = [
      h("p", { class: "muted" }, `${worker.hostname} · `, h("span", { class: "mono", text: worker.id })),
      h(
        "p",
        {},
        h("span", { class: `pill ${worker.alive ? "on" : "off"}`, "data-testid": "worker-alive", text: worker.alive ? "alive" : "no heartbeat" }),
        ` heartbeat ${fmtDuration(worker.heartbeat_age_s)} ago`,
      ),
      h("p", { text: capacity ? `Memory: ${fmtBytes(capacity)}` : `CPU worker · host memory ${fmtBytes(hw.host_memory)}` }),
      report.error ? h("p", { class: "bad", text: `Hardware probe failed: ${report.error}` }) : null,
      h("p", { class: "muted", text: enabled.length ? `Optimizations on by default: ${enabled.join(", ")}` : "No optimization on by default here" }),
    ];
    if (current) {
      const { job, metric } = current;
      const used = metric ? metric.gpu_mem_reserved ?? metric.gpu_mem_allocated : null;
      body.push(
        h(
          "div",
          { class: "current", "data-testid": "worker-job" },
          h("p", {}, "Running ", h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) }), " ", statusBadge(job.status)),
          progressBar(job.progress.step, job.progress.total_steps),
          metric ? h("p", { text: `${fmtCompact(metric.tokens_per_s)} tokens/s` }) : null,
          used !== null && used !== undefined && capacity
            ? h(
                "div",
                { class: "membar" },
                h("meter", { min: 0, max: capacity, value: used, high: capacity * 0.9, "aria-label": "GPU memory in use" }),
                h("span", { text: `${fmtBytes(used)} of ${fmtBytes(capacity)} reserved` }),
              )
            : metric && metric.host_rss
              ? h("p", { text: `Host RSS ${fmtBytes(metric.host_rss)}` })
              : null,
        ),
      );
    } else {
      body.push(h("p", { class: "idle", "data-testid": "worker-idle", text: worker.current_job ? `Job ${worker.current_job}` : "Idle" }));
    }
    return h("article", { class: "card", "data-testid": "worker-card", "data-worker-id": worker.id }, h("h3", { text: heading }), body);
  }

  async function refresh() {
    try {
      const [workers, queued] = await Promise.all([api("/v1/hardware"), apiAll("/v1/jobs?status=queued", { max: 1000 })]);
      const currents = await Promise.all(
        workers.data.map((w) => (w.current_job ? currentJob(w.current_job).catch(() => null) : null)),
      );
      if (poll.stopped) return;
      clear(
        workersEl,
        workers.data.length
          ? workers.data.map((w, i) => workerCard(w, currents[i]))
          : h("p", { class: "muted", text: "No worker has registered. Start one with `ftq worker` (or `ftq up`)." }),
      );
      renderQueue(queued);
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
      clear(problem);
    } catch (err) {
      clear(problem, errorBox(err, "gpus-error"));
    }
  }

  function renderQueue(queued) {
    const ordered = [...queued].sort((a, b) => parseTime(a.created_at) - parseTime(b.created_at) || a.id.localeCompare(b.id));
    if (!ordered.length) {
      clear(queueEl, h("p", { class: "muted", "data-testid": "queue-empty", text: "Nothing is waiting." }));
      return;
    }
    clear(
      queueEl,
      h(
        "table",
        { "data-testid": "queue-table" },
        h("thead", {}, h("tr", {}, ["Position", "Job", "Model", "Waiting"].map((t) => h("th", { scope: "col", text: t })))),
        h(
          "tbody",
          {},
          ordered.map((job, i) =>
            h(
              "tr",
              { "data-testid": "queue-row", "data-job-id": job.id, "data-position": String(i + 1) },
              h("td", { class: "num", text: String(i + 1) }),
              h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) })),
              h("td", { class: "mono", text: job.model }),
              h("td", { text: fmtAge(job.created_at) }),
            ),
          ),
        ),
      ),
    );
  }

  const poll = poller(refresh, POLL_MS);
  return () => poll.stop();
}

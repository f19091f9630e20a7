// GPUs: every worker of the box (one per GPU) with its device, liveness,
// current job and that job's memory against the card's capacity; then the
// queue (GET /v1/queue) in claim order with each waiting job's position and
// estimated start.
//
// Claim order is priority (high, normal, low), then age; a job whose owner is
// at their cap on running jobs keeps its place but waits (core/jobs/scheduling.py).

import { api } from "./api.js";
import { h, clear, fmtAge, fmtBytes, fmtCompact, fmtDuration, fmtEta, fmtTime, jobTitle, progressBar, errorBox, poller, statusBadge } from "./dom.js";

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

  function workerCard(worker, current, finishAt) {
    const report = worker.hardware || {};
    const hw = report.hardware || report;
    const capacity = hw.gpu_memory || null;
    const plan = worker.plan || report.plan || null;
    const decisions = plan?.decisions || [];
    // attention and loss always pick a backend; the rest are optimizations that may be on or off.
    const enabled = decisions.filter((d) => d.enabled && d.name !== "attention" && d.name !== "loss").map((d) => d.name);
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
          h("p", { class: "muted", "data-testid": "worker-job-eta", text: `Estimated finish: ${finishAt ? `${fmtEta(finishAt)} (${fmtTime(finishAt)})` : "unknown"}` }),
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
      const [workers, queue] = await Promise.all([api("/v1/hardware"), api("/v1/queue")]);
      const finishAt = Object.fromEntries(queue.running.map((r) => [r.id, r.estimated_finish_at]));
      const currents = await Promise.all(
        workers.data.map((w) => (w.current_job ? currentJob(w.current_job).catch(() => null) : null)),
      );
      if (poll.stopped) return;
      clear(
        workersEl,
        workers.data.length
          ? workers.data.map((w, i) => workerCard(w, currents[i], w.current_job ? finishAt[w.current_job] : null))
          : h("p", { class: "muted", text: "No worker has registered. Start one with `ftq worker` (or `ftq up`)." }),
      );
      renderQueue(queue);
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
      clear(problem);
    } catch (err) {
      clear(problem, errorBox(err, "gpus-error"));
    }
  }

  function renderQueue(queue) {
    const waiting = queue.data;
    if (!waiting.length) {
      clear(queueEl, h("p", { class: "muted", "data-testid": "queue-empty", text: "Nothing is waiting." }));
      return;
    }
    const cap = queue.max_running_jobs_per_user;
    clear(
      queueEl,
      h("p", { class: "muted", "data-testid": "queue-rules", text: `Claim order: priority (high, normal, low), then age. ${cap ? `Each user runs at most ${cap} job${cap === 1 ? "" : "s"} at once (unless their own cap differs); their next job waits.` : "No per-user cap."} Estimates assume ${queue.live_workers} live worker${queue.live_workers === 1 ? "" : "s"}.` }),
      h(
        "table",
        { "data-testid": "queue-table" },
        h("thead", {}, h("tr", {}, ["Position", "Job", "Priority", "Owner", "Model", "Waiting", "Estimated start"].map((t) => h("th", { scope: "col", text: t })))),
        h(
          "tbody",
          {},
          waiting.map((job) =>
            h(
              "tr",
              { "data-testid": "queue-row", "data-job-id": job.id, "data-position": String(job.position) },
              h("td", { class: "num", text: String(job.position) }),
              h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) })),
              h("td", { "data-testid": "queue-priority", text: job.priority }),
              h("td", { text: job.owner || "–" }),
              h("td", { class: "mono", text: job.model }),
              h("td", { text: fmtAge(job.created_at) }),
              h("td", { "data-testid": "queue-eta", title: job.estimated_start_at ? fmtTime(job.estimated_start_at) : "no estimate: no live worker, or no pace to go by", text: fmtEta(job.estimated_start_at) }),
            ),
          ),
        ),
      ),
    );
  }

  const poll = poller(refresh, POLL_MS);
  return () => poll.stop();
}

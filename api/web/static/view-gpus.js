// GPUs: every machine (GET /v1/hardware `machines`: the worker hosts reporting one
// hostname and address) with its status (`lost` once none of its workers has beaten
// within FTQ_HEARTBEAT_TIMEOUT_S: the reaper requeues its jobs and frees its GPUs),
// then each of its worker hosts with its GPUs (its pool), which job holds each GPU (a multi-GPU job spans several, one rank each), its
// liveness, and each running job's progress and memory per GPU against the
// card's capacity; then the queue (GET /v1/queue) in claim order with each
// waiting job's GPU count, position and estimated start.
//
// Claim order is priority (high, normal, low), then age. A job needs its GPUs
// on one host; the first job that fits no host yet holds the host it waits for
// (later jobs only use other hosts' GPUs), and a job whose owner's running jobs
// hold their cap of GPUs keeps its place but waits (core/jobs/placement.py). A
// retry whose checkpoints are in a shared storage no live worker mounts says so
// under its name (`waits_for`: the storage, its directory, the checkpoint's step).
//
// Every GPU says which project holds it; another project's job shows only that
// (GPUs are shared by scheduling, the work on them is the project's), and in the
// queue such a job shows its project, GPUs, priority and estimate, no name.
//
// A Slurm bridge (worker.pool, docs/slurm.md) shows its partition as Slurm reports
// it: nodes and GPUs (or CPUs) idle and allocated, and ftq's Slurm jobs with their
// state and pending reason; a job queued for it shows "Slurm decides", no estimate.

import { api } from "./api.js";
import { h, clear, fmtAge, fmtBytes, fmtCompact, fmtDuration, fmtEta, fmtTime, jobTitle, progressBar, errorBox, poller, statusBadge } from "./dom.js";

const POLL_MS = 3000;

export function renderGpus(main) {
  const workersEl = h("div", { class: "machines", "data-testid": "workers" });
  const queueEl = h("div", { "data-testid": "queue" });
  const problem = h("div");
  const updated = h("span", { class: "muted", "data-testid": "gpus-updated" });
  clear(
    main,
    h("div", { class: "view-head" }, h("h1", { text: "GPUs" }), updated),
    problem,
    h("section", { "aria-labelledby": "workers-h" }, h("h2", { id: "workers-h", text: "Machines" }), workersEl),
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

  /** The jobs holding a worker's GPUs, in slot order (an older worker without a pool: its current job). */
  function jobsOf(worker) {
    const ids = (worker.gpus || []).map((g) => g.job).filter(Boolean);
    if (!worker.gpus?.length && worker.current_job) ids.push(worker.current_job);
    return [...new Set(ids)];
  }

  function slotStrip(worker, jobs) {
    const gpus = worker.gpus || [];
    if (!gpus.length) return null;
    return h(
      "div",
      { class: "gpu-slots", "data-testid": "gpu-slots" },
      gpus.map((g) => {
        const current = g.job ? jobs.get(g.job) : null;
        const mine = gpus.filter((x) => x.job && x.job === g.job);
        const rank = mine.indexOf(g);
        const name = g.device !== null && g.device !== undefined ? `GPU ${g.device}` : `Slot ${g.slot}`;
        const held = g.job || g.project;
        return h(
          "div",
          { class: `gpu-slot${held ? " busy" : ""}`, "data-testid": "gpu-slot", "data-slot": String(g.slot), "data-job-id": g.job || "", "data-project": g.project || "" },
          h("span", { class: "gpu-name", text: name }),
          g.job
            ? h("a", { href: `#/jobs/${encodeURIComponent(g.job)}`, title: g.job, text: current ? jobTitle(current.job) : g.job })
            : h("span", { class: held ? "muted" : "free", text: held ? "another project's job" : "free" }),
          g.project ? h("span", { class: "muted", "data-testid": "gpu-project", text: `project ${g.project}` }) : null,
          g.job && mine.length > 1 ? h("span", { class: "muted", "data-testid": "gpu-rank", text: `rank ${rank} of ${mine.length}` }) : null,
        );
      }),
    );
  }

  function memoryBars(metric, capacity) {
    const perRank = Array.isArray(metric?.ranks) ? metric.ranks : [metric];
    const bars = perRank.map((r, i) => {
      const used = r ? r.gpu_mem_reserved ?? r.gpu_mem_allocated : null;
      const label = perRank.length > 1 ? `rank ${r?.rank ?? i}: ` : "";
      if (used !== null && used !== undefined && capacity) {
        return h(
          "div",
          { class: "membar", "data-testid": "gpu-memory" },
          h("meter", { min: 0, max: capacity, value: used, high: capacity * 0.9, "aria-label": `GPU memory in use${label ? ` (${label.slice(0, -2)})` : ""}` }),
          h("span", { text: `${label}${fmtBytes(used)} of ${fmtBytes(capacity)} reserved` }),
        );
      }
      return r && r.host_rss ? h("p", { "data-testid": "gpu-memory", text: `${label}host RSS ${fmtBytes(r.host_rss)}` }) : null;
    });
    return bars.filter(Boolean);
  }

  function jobBlock(current, finishAt, capacity) {
    const { job, metric } = current;
    return h(
      "div",
      { class: "current", "data-testid": "worker-job", "data-job-id": job.id },
      h("p", {}, "Running ", h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) }), " ", statusBadge(job.status),
        job.gpus > 1 ? h("span", { class: "muted", text: ` on ${job.gpus} GPUs` }) : null),
      progressBar(job.progress.step, job.progress.total_steps),
      metric ? h("p", { text: `${fmtCompact(metric.tokens_per_s)} tokens/s` }) : null,
      h("p", { class: "muted", "data-testid": "worker-job-eta", text: `Estimated finish: ${finishAt ? `${fmtEta(finishAt)} (${fmtTime(finishAt)})` : "unknown"}` }),
      metric ? memoryBars(metric, capacity) : null,
    );
  }

  /** A Slurm bridge's partition as Slurm reports it (GET /v1/hardware `pool`). */
  function poolBlock(pool) {
    const c = pool.cluster || {};
    const count = (x) => (x ? `${x.idle ?? 0} idle, ${x.allocated ?? 0} allocated` : "unknown");
    const unit = pool.unit === "gpu" ? "GPUs" : "CPU slots";
    return h(
      "div",
      { class: "pool", "data-testid": "slurm-pool", "data-partition": pool.partition || "" },
      h("p", { text: `Slurm partition ${pool.partition} · ${pool.nodes} node${pool.nodes === 1 ? "" : "s"} × ${pool.per_node} ${unit} · pool "${pool.name}"` }),
      h("p", { "data-testid": "slurm-nodes", text: `Nodes: ${count(c.nodes)}${c.nodes?.other ? `, ${c.nodes.other} down or drained` : ""}` }),
      h("p", { "data-testid": "slurm-gpus", text: c.gpus?.total ? `GPUs: ${count(c.gpus)}` : `CPUs: ${count(c.cpus)}` }),
      (c.jobs || []).length
        ? h("ul", { "data-testid": "slurm-jobs" }, c.jobs.map((j) => h("li", { "data-testid": "slurm-job", "data-job-id": j.job_id || "" },
            j.job_id ? h("a", { href: `#/jobs/${encodeURIComponent(j.job_id)}`, text: j.job_id }) : h("span", { class: "muted", text: "another project's job" }),
            ` · Slurm job ${j.slurm_job_id}: ${j.state}${j.reason && j.reason !== "None" ? ` (${j.reason})` : ""}`)))
        : h("p", { class: "muted", text: "No ftq job in Slurm's queue." }),
      pool.observed_at ? h("p", { class: "muted", text: `Reported by Slurm ${fmtTime(pool.observed_at)}` }) : null,
    );
  }

  function workerCard(worker, jobs, finishAt) {
    const report = worker.hardware || {};
    const hw = report.hardware || report;
    const capacity = hw.gpu_memory || null;
    const plan = worker.plan || report.plan || null;
    const decisions = plan?.decisions || [];
    // attention and loss always pick a backend; the rest are optimizations that may be on or off.
    const enabled = decisions.filter((d) => d.enabled && d.name !== "attention" && d.name !== "loss").map((d) => d.name);
    const count = (worker.gpus || []).length;
    // a Slurm bridge's slots are its partition's (GPUs, or CPU task slots on a cluster without GPUs)
    const gpuWord = worker.pool ? (worker.pool.unit === "gpu" ? "GPU" : "CPU slot") : worker.device === "cpu" ? "CPU slot" : "GPU";
    const kind = worker.pool ? `Slurm pool "${worker.pool.name}"` : `${worker.device}${hw.name ? ` · ${hw.name}` : ""}`;
    const heading = `${kind}${count ? ` · ${count} ${gpuWord}${count === 1 ? "" : "s"}` : ""}`;
    const body = [
      h("p", { class: "muted" }, `${worker.hostname} · `, h("span", { class: "mono", text: worker.id })),
      h(
        "p",
        {},
        h("span", { class: `pill ${worker.alive ? "on" : "off"}`, "data-testid": "worker-alive", text: worker.alive ? "alive" : "no heartbeat" }),
        ` heartbeat ${fmtDuration(worker.heartbeat_age_s)} ago`,
      ),
      worker.pool ? null : h("p", { text: capacity ? `Memory: ${fmtBytes(capacity)} per GPU` : `CPU worker · host memory ${fmtBytes(hw.host_memory)}` }),
      report.error ? h("p", { class: "bad", text: `${worker.pool ? "Slurm report" : "Hardware probe"} failed: ${report.error}` }) : null,
      worker.pool ? poolBlock(worker.pool) : h("p", { class: "muted", text: enabled.length ? `Optimizations on by default: ${enabled.join(", ")}` : "No optimization on by default here" }),
      slotStrip(worker, jobs),
    ];
    const running = jobsOf(worker).map((jobId) => jobs.get(jobId)).filter(Boolean);
    if (running.length) {
      body.push(...running.map((current) => jobBlock(current, finishAt[current.job.id], capacity)));
    } else {
      body.push(h("p", { class: "idle", "data-testid": "worker-idle", text: jobsOf(worker).length ? `Job ${jobsOf(worker).join(", ")}` : "Idle" }));
    }
    return h("article", { class: "card", "data-testid": "worker-card", "data-worker-id": worker.id }, h("h4", { text: heading }), body);
  }

  /** One machine: its status (a lost one in a warning style, saying what happens to its jobs), then its worker hosts. */
  function machineSection(machine, byId, jobs, finishAt) {
    const lost = machine.status === "lost";
    const count = machine.gpus.length;
    const word = count && machine.gpus.every((g) => g.device === null) ? "CPU slot" : "GPU";
    const facts = [
      machine.address,
      machine.remote ? "remote (worker key)" : "local",
      `${count} ${word}${count === 1 ? "" : "s"}`,
      `heartbeat ${fmtDuration(machine.heartbeat_age_s)} ago`,
    ].filter(Boolean);
    const workers = machine.workers.map((id) => byId.get(id)).filter(Boolean);
    return h(
      "section",
      { class: `machine${lost ? " lost" : ""}`, "data-testid": "machine", "data-machine": machine.name, "data-status": machine.status, "aria-label": `Machine ${machine.name}` },
      h("div", { class: "machine-head" },
        h("h3", { text: machine.name }),
        h("span", { class: `pill ${lost ? "lost" : "on"}`, "data-testid": "machine-status", text: machine.status }),
        h("span", { class: "muted", "data-testid": "machine-facts", text: facts.join(" · ") })),
      lost
        ? h("p", { class: "warning", "data-testid": "machine-lost", text: `No heartbeat from this machine for ${fmtDuration(machine.heartbeat_age_s)}. Its running jobs are requeued to resume from their last checkpoint (or failed once out of attempts) and its GPUs freed.` })
        : null,
      h("div", { class: "cards" }, workers.map((w) => workerCard(w, jobs, finishAt))),
    );
  }

  async function refresh() {
    try {
      const [workers, queue] = await Promise.all([api("/v1/hardware"), api("/v1/queue")]);
      const finishAt = Object.fromEntries(queue.running.filter((r) => r.id).map((r) => [r.id, r.estimated_finish_at]));
      const ids = [...new Set(workers.data.flatMap(jobsOf))];
      const found = await Promise.all(ids.map((jobId) => currentJob(jobId).catch(() => null)));
      const jobs = new Map(ids.map((jobId, i) => [jobId, found[i]]).filter(([, current]) => current));
      if (poll.stopped) return;
      const byId = new Map(workers.data.map((w) => [w.id, w]));
      clear(
        workersEl,
        workers.data.length
          ? workers.machines.map((m) => machineSection(m, byId, jobs, finishAt))
          : h("p", { class: "muted", text: "No worker has registered. Start one with `ftq worker --gpus all` (or `ftq up`)." }),
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
    const hosts = `${queue.live_workers} live worker host${queue.live_workers === 1 ? "" : "s"} with ${queue.live_gpus} GPU${queue.live_gpus === 1 ? "" : "s"}`;
    clear(
      queueEl,
      h("p", { class: "muted", "data-testid": "queue-rules", text: `Claim order: priority (high, normal, low), then age. A job runs on its GPUs of one host; the first job that fits no host yet holds the host it waits for, and later jobs only use other hosts' free GPUs. ${cap ? `Each user's running jobs hold at most ${cap} GPU${cap === 1 ? "" : "s"} (unless their own cap differs); their next job waits.` : "No per-user cap."} Estimates assume ${hosts}.` }),
      h(
        "table",
        { "data-testid": "queue-table" },
        h("thead", {}, h("tr", {}, ["Position", "Job", "Project", "GPUs", "Priority", "Owner", "Model", "Waiting", "Estimated start"].map((t) => h("th", { scope: "col", text: t })))),
        h(
          "tbody",
          {},
          waiting.map((job) =>
            h(
              "tr",
              { "data-testid": "queue-row", "data-job-id": job.id || "", "data-position": String(job.position) },
              h("td", { class: "num", text: String(job.position) }),
              h("td", {}, job.id ? h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, text: jobTitle(job) }) : h("span", { class: "muted", text: "another project's job" }),
                job.holds ? h("div", { class: "muted", "data-testid": "queue-holds", text: `holds the free GPUs of ${job.holds}` }) : null,
                job.waits_for ? h("div", { class: "muted", "data-testid": "queue-waits-for", text: job.waits_for }) : null),
              h("td", { "data-testid": "queue-project", text: job.project || "–" }),
              h("td", { class: "num", "data-testid": "queue-gpus", text: String(job.gpus) }),
              h("td", { "data-testid": "queue-priority", text: job.priority }),
              h("td", { text: job.owner || "–" }),
              h("td", { class: "mono", text: job.model || "–" }),
              h("td", { text: fmtAge(job.created_at) }),
              h("td", { "data-testid": "queue-eta", title: job.decided_by ? "the cluster's scheduler starts it: ftq knows neither its queue nor its other users" : job.estimated_start_at ? fmtTime(job.estimated_start_at) : "no estimate: no live worker, or no pace to go by", text: job.decided_by || fmtEta(job.estimated_start_at) }),
            ),
          ),
        ),
      ),
    );
  }

  const poll = poller(refresh, POLL_MS);
  return () => poll.stop();
}

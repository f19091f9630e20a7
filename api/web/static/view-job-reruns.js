// The job page's daily-use actions: re-run (POST /v1/jobs/{id}/clone with the
// changes typed as a JSON merge patch of the spec), resume a failed or
// cancelled job from a chosen checkpoint (POST /v1/jobs/{id}/resume, a new
// job), the metrics as CSV, and a failure shown as its one-line cause with the
// rest (the trainer's stderr tail) folded and downloadable.

import { api } from "./api.js";
import { h, clear, errorBox } from "./dom.js";

/** Buttons and their small forms for a finished ``job`` (resume: once its checkpoints are read). */
export function rerunActions(job, signal) {
  const id = encodeURIComponent(job.id);
  const problem = h("div", { class: "rerun-problem" });
  const nodes = [h("a", { class: "button secondary", href: `/v1/jobs/${id}/metrics.csv`, download: "", "data-testid": "download-metrics", text: "Metrics (CSV)" })];

  const overrides = h("textarea", { rows: "3", cols: "44", class: "mono", "data-testid": "rerun-overrides", "aria-label": "Changes (JSON)",
    placeholder: '{"hyperparameters": {"learning_rate": 0.0001}, "name": "lower lr"}' });
  const form = h("form", { class: "rerun-form", hidden: true, "data-testid": "rerun-form" },
    h("label", { text: "Changes to the spec (JSON; empty: the same spec)" }), overrides,
    h("div", { class: "actions" }, h("button", { type: "submit", "data-testid": "rerun-submit", text: "Submit the copy" })));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    let body = {};
    try {
      body = overrides.value.trim() ? JSON.parse(overrides.value) : {};
    } catch (err) {
      clear(problem, errorBox(new Error(`changes: not valid JSON (${err.message})`), "rerun-error"));
      return;
    }
    submitNew(`/v1/jobs/${id}/clone`, body, problem, signal);
  });
  const rerun = h("button", { type: "button", class: "secondary", "data-testid": "rerun-job", text: "Re-run…" });
  rerun.addEventListener("click", () => {
    form.hidden = !form.hidden;
    if (!form.hidden) overrides.focus();
  });
  nodes.push(rerun);

  const row = h("div", { class: "actions" }, nodes);
  if (job.status === "failed" || job.status === "cancelled") {
    api(`/v1/jobs/${id}/checkpoints`, { signal })
      .then((page) => {
        const steps = page.data.map((c) => c.step);
        if (!steps.length) return;
        const step = h("select", { "data-testid": "resume-step", "aria-label": "Resume from checkpoint" },
          steps.map((s, i) => h("option", { value: String(s), text: `step ${s}`, selected: i === steps.length - 1 })));
        const resume = h("button", { type: "button", "data-testid": "resume-job", text: "Resume from" });
        resume.addEventListener("click", () => submitNew(`/v1/jobs/${id}/resume`, { step: Number(step.value) }, problem, signal));
        row.append(h("span", { class: "inline" }, resume, step));
      })
      .catch(() => {}); // no resume offered; the checkpoints section shows the error
  }
  return h("div", { class: "reruns", "data-testid": "job-reruns" }, row, form, problem);
}

async function submitNew(path, body, problem, signal) {
  clear(problem);
  try {
    const job = await api(path, { method: "POST", json: body, signal });
    window.location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
  } catch (err) {
    if (err.name !== "AbortError") clear(problem, errorBox(err, "rerun-error"));
  }
}

/** A failed job's error: code and one line, the detail folded with a download of it. */
export function jobErrorBox(job) {
  const { code, message, detail } = job.error;
  const fold = detail
    ? h("details", { class: "error-detail", "data-testid": "job-error-detail" },
      h("summary", { text: "Details (the trainer's output)" }),
      h("pre", { text: detail }),
      h("a", { href: URL.createObjectURL(new Blob([`${code}: ${message}\n${detail}\n`], { type: "text/plain" })),
        download: `${job.id}-error.txt`, "data-testid": "job-error-download", text: "Download" }))
    : null;
  return h("div", { class: "error-box", role: "alert", "data-testid": "job-error" },
    h("strong", { text: code }), message ? `: ${message}` : "", fold);
}

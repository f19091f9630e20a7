// The job page's results: the summary the store keeps (final and best train and
// eval loss, trained tokens, skipped non-finite steps), the submission's
// preflight with its warnings, and the greedy sample generations the trainer
// writes at each checkpoint and at the end (`sample` events), newest first, so a
// team sees what the model says, not just a number.

import { h, clear, fmtCompact, fmtNumber } from "./dom.js";
import { preflightPanel } from "./preflight.js";

export function jobResults() {
  const summary = h("dl", { class: "kv", "data-testid": "results-summary" });
  const warnings = h("div", { "data-testid": "preflight-warnings" });
  const panel = preflightPanel("job-preflight");
  const samples = h("div", { class: "samples", "data-testid": "samples" }, h("p", { class: "muted", text: "Sample generations appear at each checkpoint when the job asks for sample_prompts or sample_count." }));
  const preflightWrap = h("details", { class: "preflight-wrap" }, h("summary", { text: "Preflight (the data as the model saw it at submission)" }), panel.element);
  const element = h(
    "section",
    { "aria-labelledby": "results-h", "data-testid": "results" },
    h("h2", { id: "results-h", text: "Results" }),
    summary,
    warnings,
    h("h3", { text: "Sample generations" }),
    samples,
    preflightWrap,
  );
  const bySteps = new Map();

  function setJob(job) {
    const s = job.summary;
    const rows = s
      ? [
          ["Train loss (final / best)", `${fmtNumber(s.final_train_loss, 4)} / ${fmtNumber(s.best_train_loss, 4)}`],
          ["Eval loss (final / best)", s.final_eval_loss === null ? "no validation set" : `${fmtNumber(s.final_eval_loss, 4)} / ${fmtNumber(s.best_eval_loss, 4)} (step ${s.best_eval_step})`],
          ["Trained tokens", fmtCompact(s.trained_tokens)],
          ["Skipped steps (NaN/inf)", String(s.skipped_steps)],
        ]
      : [["Summary", "after the first step"]];
    clear(summary, rows.flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { "data-testid": `summary-${k.split(" ")[0].toLowerCase()}`, text: v })]));
    const preflight = job.preflight;
    clear(warnings, (preflight?.warnings || []).map((w) => h("p", { class: "warning", "data-testid": "job-warning", text: w })));
    if (preflight) panel.show(preflight);
  }

  function addSample(event) {
    bySteps.set(event.step, event);
    const ordered = [...bySteps.values()].sort((a, b) => b.step - a.step);
    clear(
      samples,
      ordered.map((e) =>
        h(
          "div",
          { class: "sample-step", "data-testid": "sample-step", "data-step": String(e.step) },
          h("h4", { text: `Step ${e.step}${e.final ? " (final)" : ""}` }),
          (e.samples || []).map((s) => h("div", { class: "sample" }, h("p", { class: "sample-prompt", text: s.prompt }), h("pre", { class: "sample-completion", "data-testid": "sample-completion", text: s.completion }))),
        ),
      ),
    );
  }

  return { element, setJob, addSample };
}

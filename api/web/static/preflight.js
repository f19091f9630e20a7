// Preflight on the new-job form and the job page: the dataset as the model's own
// tokenizer and chat template see it (POST /v1/jobs/preview answers it without
// creating a job; a created job keeps it as job.preflight): records, trainable
// tokens and their share, what max_seq_len truncation cuts, one rendered record
// with its trainable tokens marked, and the warnings the job stores.

import { h, clear, fmtCompact } from "./dom.js";

/** A panel showing a preflight report (PreflightOut); `show(report)` fills it. */
export function preflightPanel(testid = "preflight") {
  const element = h("section", { class: "preflight", "data-testid": testid, hidden: true });
  return {
    element,
    show(report) {
      element.hidden = false;
      clear(element, ...renderReport(report));
    },
    hide() {
      element.hidden = true;
      clear(element);
    },
  };
}

function renderReport(report) {
  const title = h("h3", { text: "Preflight" });
  if (!report.checked) return [title, h("p", { class: "muted", "data-testid": "preflight-note", text: report.note || "not checked" })];
  const pct = `${(report.trainable_fraction * 100).toFixed(1)}%`;
  const rows = [
    ["Records", `${report.records}${report.capped ? " (first ones only)" : ""} (${report.format})`],
    ["Tokens", fmtCompact(report.tokens)],
    ["Trainable tokens", `${fmtCompact(report.trainable_tokens)} (${pct})`],
    ["Longer than max_seq_len", `${report.truncated_records} records; truncation cuts ${fmtCompact(report.truncated_tokens)} tokens (${fmtCompact(report.truncated_trainable_tokens)} trainable)`],
  ];
  if (report.dropped_records) rows.push(["Skipped", `${report.dropped_records} records keep no trainable token`]);
  if (report.validation) rows.push(["Validation", `${report.validation.records} records, ${fmtCompact(report.validation.trainable_tokens)} trainable tokens`]);
  const table = h("dl", { class: "kv", "data-testid": "preflight-counts" }, rows.flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: v })]));
  const warnings = (report.warnings || []).map((w) => h("p", { class: "warning", "data-testid": "preflight-warning", text: w }));
  const example = h(
    "pre",
    { class: "preflight-example", "data-testid": "preflight-example", title: "One record as the model sees it; highlighted tokens are trained on" },
    (report.example || []).map((run) => h("span", { class: run.trainable ? "trainable" : "prompt", text: run.text })),
  );
  return [title, table, ...warnings, h("p", { class: "help", text: "One record, rendered with the model's template; highlighted text is what the loss is taken on:" }), example];
}

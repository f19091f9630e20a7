// A generation job's page section (kind: generate, docs/generation.md): prompts done of the total
// and tokens/s from its progress events, a preview of the first completions written so far
// (GET /v1/jobs/{id}/completions/preview), and the download of completions.jsonl once it succeeded.

import { api } from "./api.js";
import { h, clear, errorBox, fmtCompact, progressBar } from "./dom.js";

const PREVIEW = 5;

/** The section for job ``id`` (URL-encoded); ``update(job, progress?)`` redraws it; ``reload()`` after a resume. */
export function generationSection(id, signal, reload) {
  const bar = h("div", { class: "progress-area", "data-testid": "generation-progress" });
  const rate = h("p", { class: "muted", "data-testid": "generation-rate" });
  const download = h("p");
  const preview = h("div", { "data-testid": "generation-preview" });
  const problem = h("div");
  const element = h(
    "section",
    { "aria-labelledby": "gen-h", "data-testid": "generation" },
    h("h2", { id: "gen-h", text: "Completions" }),
    bar,
    rate,
    download,
    problem,
    preview,
  );
  let shown = -1;

  async function refreshPreview(done) {
    if (done === shown && shown >= PREVIEW) return; // the first lines do not change once written
    try {
      const body = await api(`/v1/jobs/${id}/completions/preview?limit=${PREVIEW}`, { signal });
      shown = done;
      clear(problem);
      clear(preview, body.data.length ? previewTable(body.data) : h("p", { class: "muted", text: "No completion yet." }));
    } catch (err) {
      if (err.name !== "AbortError") clear(problem, errorBox(err, "generation-preview-error"));
    }
  }

  async function resume() {
    try {
      await api(`/v1/jobs/${id}/resume`, { method: "POST", signal });
      reload();
    } catch (err) {
      if (err.name !== "AbortError") clear(problem, errorBox(err, "generation-resume-error"));
    }
  }

  function update(job, progress) {
    const state = progress || job.generation || {};
    const done = state.prompts_done ?? 0;
    const total = state.prompts_total ?? job.preflight?.records ?? null;
    clear(bar, progressBar(done, total), h("span", { class: "muted", text: ` ${done} of ${total ?? "?"} prompts` }));
    rate.textContent = state.tokens_per_s ? `${fmtCompact(state.tokens_per_s)} generated tokens/s` : "";
    clear(download, job.status === "succeeded"
      ? h("a", { class: "button", href: `/v1/jobs/${id}/completions`, download: "", "data-testid": "download-completions", text: "Download completions (.jsonl)" })
      : job.status === "cancelled"
        ? h("button", { type: "button", "data-testid": "resume-generation", on: { click: resume }, text: "Resume (continues at the first undone prompt)" })
        : null);
    refreshPreview(done);
  }

  return { element, update };
}

function previewTable(lines) {
  const rows = lines.map((line) => {
    const prompt = line.prompt ?? (line.messages || []).map((m) => `${m.role}: ${typeof m.content === "string" ? m.content : "…"}`).join("\n");
    const choice = (line.choices || [])[0] || {};
    return h(
      "tr",
      {},
      h("td", { text: String(line.index) }),
      h("td", { class: "pre", text: prompt }),
      h("td", { class: "pre", "data-testid": "completion-text", text: choice.text ?? "" }),
      h("td", { text: `${choice.finish_reason ?? ""}${(line.choices || []).length > 1 ? ` (+${line.choices.length - 1} more)` : ""}` }),
    );
  });
  return h(
    "table",
    { class: "table" },
    h("thead", {}, h("tr", {}, ["#", "Prompt", "Completion", "Finish"].map((t) => h("th", { text: t })))),
    h("tbody", {}, rows),
  );
}

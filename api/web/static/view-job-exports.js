// A succeeded job's exports: buttons that ask for a merged model or a GGUF
// (POST /v1/jobs/{id}/exports), a table of its exports with their progress,
// polled while one is queued or running, and a download link once done.

import { api } from "./api.js";
import { h, clear, fmtBytes, fmtTime, errorBox } from "./dom.js";

const POLL_MS = 1500;
// Presets, not the lists: the formats and quantizations are trainer.catalog's
// (EXPORT_FORMATS, QUANTIZATIONS); tests/unit/test_catalog_contracts.py checks
// that each button names listed values and that every format has a button.
const KINDS = [
  { label: "Export merged (safetensors)", body: { format: "merged" }, testid: "export-merged" },
  { label: "Export GGUF (f16)", body: { format: "gguf", quantization: "f16" }, testid: "export-gguf" },
  { label: "Export GGUF (q8_0)", body: { format: "gguf", quantization: "q8_0" }, testid: "export-gguf-q8_0" },
];

/** The exports section of job ``id`` (URL-encoded); polling stops when ``signal`` aborts. */
export function exportsSection(id, signal) {
  const table = h("div", { "data-testid": "exports" });
  const problem = h("div");
  const buttons = KINDS.map((kind) =>
    h("button", { type: "button", class: "secondary", "data-testid": kind.testid, on: { click: () => ask(kind.body) }, text: kind.label }),
  );
  let timer = 0;

  async function ask(body) {
    clear(problem);
    try {
      await api(`/v1/jobs/${id}/exports`, { method: "POST", json: body, signal });
      await refresh();
    } catch (err) {
      if (err.name !== "AbortError") clear(problem, errorBox(err, "export-error"));
    }
  }

  async function refresh() {
    clearTimeout(timer);
    const list = await api(`/v1/jobs/${id}/exports`, { signal });
    render(list.data);
    if (list.data.some((e) => e.status === "queued" || e.status === "running") && !signal.aborted) {
      timer = setTimeout(() => refresh().catch(() => {}), POLL_MS);
    }
  }

  function render(rows) {
    if (!rows.length) {
      clear(table, h("p", { class: "muted", text: "Merged: the base with the adapter folded in (safetensors, loads with transformers). GGUF: one file for llama.cpp, chat template included." }));
      return;
    }
    clear(
      table,
      h(
        "table",
        { class: "checkpoints-table", "data-testid": "export-table" },
        h("thead", {}, h("tr", {}, ["Export", "Status", "Size", "Asked", ""].map((t) => h("th", { scope: "col", text: t })))),
        h("tbody", {}, rows.map(row)),
      ),
    );
  }

  function row(e) {
    const kind = e.format + (e.quantization ? ` (${e.quantization})` : "");
    let state = e.status;
    if (e.status === "running") state = `${e.stage || "running"} ${(100 * e.progress).toFixed(0)}%`;
    if (e.status === "failed") state = `failed: ${e.error_message || e.error_code}`;
    const link = e.download_url
      ? h("a", { href: e.download_url, download: "", "data-testid": "download-export", text: "Download" })
      : h("span", { class: "muted", text: "" });
    return h(
      "tr",
      { "data-testid": "export-row", "data-status": e.status, "data-format": e.format },
      h("td", { text: kind }),
      h("td", { text: state }),
      h("td", { class: "num", text: e.bytes ? fmtBytes(e.bytes) : "" }),
      h("td", { text: fmtTime(e.created_at) }),
      h("td", {}, link),
    );
  }

  refresh().catch((err) => { if (err.name !== "AbortError") clear(problem, errorBox(err, "export-error")); });
  signal.addEventListener("abort", () => clearTimeout(timer));
  return h(
    "section",
    { "aria-labelledby": "exports-h", "data-testid": "exports-section" },
    h("h2", { id: "exports-h", text: "Exports" }),
    h("div", { class: "actions" }, buttons),
    problem,
    table,
  );
}

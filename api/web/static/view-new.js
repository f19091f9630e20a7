// New job: pick a local model, upload (and at once validate) a dataset, set the
// hyperparameters and the optimization switches, submit.
//
// Every input carries `data-param` with the API's name for it
// ("hyperparameters.learning_rate"), so a 422 from POST /v1/jobs is shown next
// to the field it names (its `details` list every problem, not just the first).
//
// The switches are not listed here: the API's OpenAPI schema has them
// (components.schemas.OptimizationSwitches, built from the trainer's one list,
// trainer.config.Optimizations), each with its title, description, values and
// default, so a switch the trainer gains shows up on this form by itself.
//
// The other fields' defaults are not here either: the inputs start empty with
// the API's default as their placeholder (read from the same schema: the job
// spec, core/jobs/spec.py, defines them once), and an empty input is left out
// of the body, so the API fills in exactly what the placeholder showed. A
// select's values are the schema's enum (the LR schedules: trainer.catalog's
// SCHEDULERS), its default selected.

import { api, ApiError, selectedProject } from "./api.js";
import { h, clear, fmtBytes, fmtCompact, errorBox } from "./dom.js";
import { preflightPanel } from "./preflight.js";

const MAX_BAD_LINE_SCAN = 32 << 20; // read at most 32 MiB of the local file to show a bad line
const SWITCH_SCHEMA = "OptimizationSwitches";
let switchList = null; // the switches read from /openapi.json (a promise), once per page load

// [param, label, initial value ("": the API's default, shown as placeholder), attributes, help]
const HYPER = [
  ["hyperparameters.learning_rate", "Learning rate", "", { step: "any", min: "0" }, "Peak AdamW learning rate."],
  ["hyperparameters.lr_scheduler", "LR schedule", "", null, "Decay after warm-up."],
  ["hyperparameters.warmup_steps", "Warm-up steps", "", { min: "0", step: "1" }, "Linear warm-up; must be below max steps."],
  ["hyperparameters.batch_tokens", "Tokens per batch", "", { min: "64", step: "1" }, "Packing budget: real tokens per micro-batch (no padding)."],
  ["hyperparameters.max_seq_len", "Max sequence length", "", { min: "8", step: "1" }, "Longer samples are truncated; at most tokens per batch."],
  ["hyperparameters.grad_accum", "Gradient accumulation", "", { min: "1", step: "1" }, "Micro-batches per optimizer step."],
  ["hyperparameters.seed", "Seed", "", { min: "0", step: "1" }, "Seeds weights of the adapter and the data order."],
  ["checkpoint_every", "Checkpoint every (steps)", "", { min: "0", step: "1" }, "0 keeps only the final adapter."],
  ["eval_every", "Evaluate every (steps)", "", { min: "0", step: "1" }, "Validation loss every N steps and at the end; 0: at each checkpoint."],
  ["max_non_finite_steps", "Stop after NaN steps", "", { min: "1", step: "1" }, "Steps in a row with a NaN/inf loss (each skipped) before the job fails, keeping its last checkpoint."],
];
const LORA = [
  ["lora.r", "LoRA rank r", "", { min: "1", step: "1" }, "Adapter rank."],
  ["lora.alpha", "LoRA alpha", "", { min: "1", step: "1" }, "The update is scaled by alpha / r."],
  ["lora.dropout", "LoRA dropout", "", { min: "0", max: "0.99", step: "any" }, "Dropout on the adapter input."],
  ["lora.target_modules", "Target modules", "", null, "Comma-separated module names (q_proj, v_proj) or all-linear."],
];

/** "1 record", "2 records", "1,024 records". */
const plural = (n, word) => `${Number(n).toLocaleString()} ${word}${n === 1 ? "" : "s"}`;

let nextId = 0;
const uid = (base) => `${base}-${(nextId += 1)}`;

export function renderNew(main) {
  const controller = new AbortController();
  const form = h("form", { class: "job-form", "data-testid": "new-job-form", novalidate: true });
  const formError = h("div", { "data-testid": "form-error", "aria-live": "assertive" });

  const model = modelPicker(controller.signal);
  const tokenContext = { model: () => model.value(), maxSeqLen: () => form.querySelector('[data-param="hyperparameters.max_seq_len"]')?.value };
  const train = datasetPicker({ purpose: "train", label: "Training data", param: "training_file", required: true, signal: controller.signal, tokenContext });
  const valid = datasetPicker({ purpose: "validation", label: "Validation data (optional)", param: "validation_file", required: false, signal: controller.signal, tokenContext });
  model.onChange(() => {
    train.refreshTokens();
    valid.refreshTokens();
  });

  const name = field("name", "Job name (optional)", h("input", { type: "text", maxlength: "200", placeholder: "e.g. support-bot-v3" }));
  const gpus = gpusField(controller.signal);
  // The objectives, their names for people and their settings come from the job spec's schema
  // (trainer.objectives' registry): a registered objective shows up here by itself.
  const objective = field("objective", "Objective", h("select", {}),
    "What the job learns from: each objective trains on its own kind of records (the choice's description in the API docs).");
  const objectiveSelect = objective.querySelector("select");
  const sectionFields = []; // [objective name, field] of every objective's settings
  const showSection = () => { for (const [name, wrap] of sectionFields) wrap.hidden = objectiveSelect.value !== name; };
  objectiveSelect.addEventListener("change", showSection);
  const lengthUnit = h(
    "select",
    { "data-testid": "length-unit", "aria-label": "Length unit" },
    h("option", { value: "max_steps", text: "steps" }),
    h("option", { value: "epochs", text: "epochs" }),
  );
  const lengthValue = h("input", { type: "number", min: "0", step: "any", placeholder: "empty: 1 epoch", "data-param": "hyperparameters.max_steps", "data-testid": "field-length" });
  lengthUnit.addEventListener("change", () => {
    lengthValue.dataset.param = `hyperparameters.${lengthUnit.value}`;
  });
  const lengthId = uid("length");
  lengthValue.id = lengthId;
  const lengthField = h(
    "div",
    { class: "field", "data-field": "length" },
    h("label", { for: lengthId, text: "Train for" }),
    h("div", { class: "inline" }, lengthValue, lengthUnit),
    h("p", { class: "help", text: "A number of optimizer steps, or passes over the training data." }),
    h("p", { class: "field-error", role: "alert" }),
  );

  const hyperFields = HYPER.map(([param, label, value, attrs, help]) =>
    param === "hyperparameters.lr_scheduler"
      ? field(param, label, h("select", {}), help) // its options: the schema's enum (showDefaults)
      : field(param, label, h("input", { type: "number", value, ...attrs }), help),
  );
  const loraFields = LORA.map(([param, label, value, attrs, help]) =>
    field(param, label, h("input", { type: attrs ? "number" : "text", value, ...(attrs || {}) }), help),
  );
  const switches = h("div", { class: "switches", "data-testid": "switches" }, h("p", { class: "muted", text: "Loading the optimization switches…" }));
  loadDefaults()
    .then((defaults) => {
      for (const section of defaults.sections) {
        const wrap = field(section.param, section.label, h("input", { type: "number", step: "any" }), section.help);
        sectionFields.push([section.objective, wrap]);
      }
      objective.after(...sectionFields.map(([, wrap]) => wrap));
      showDefaults([objective, ...hyperFields, ...loraFields, ...sectionFields.map(([, wrap]) => wrap)], defaults);
      for (const option of objectiveSelect.options) option.text = defaults.titles[option.value] || option.value;
      showSection();
    })
    .catch(() => {}); // a hint: an empty input or schedule is left out, and the API fills its default in
  loadSwitches()
    .then((list) => clear(switches, list.map(switchField)))
    .catch((err) => clear(switches, errorBox(err, "switches-error")));

  const submit = h("button", { type: "submit", "data-testid": "submit-job", text: "Submit job" });
  const preview = h("button", { type: "button", class: "secondary", "data-testid": "preview-job", text: "Preview data" });
  const panel = preflightPanel();
  const samplePrompts = field("sample_prompts", "Sample prompts (one per line)", h("textarea", { rows: "2", placeholder: "optional: answered greedily at each checkpoint, shown on the job page" }));
  const project = selectedProject();
  clear(
    form,
    h("p", { class: "muted", "data-testid": "new-project", text: project
      ? `This job and its uploads go to project ${project} (the switcher in the header changes it).`
      : "This job and its uploads go to your default project (pick one with the switcher in the header)." }),
    h("fieldset", {}, h("legend", { text: "Model" }), model.element),
    h("fieldset", {}, h("legend", { text: "Data" }), train.element, valid.element),
    h("fieldset", { "data-param": "hyperparameters" }, h("legend", { text: "Training" }), h("div", { class: "grid" }, name, lengthField, gpus, objective, ...hyperFields), h("p", { class: "field-error", role: "alert" })),
    h("fieldset", { "data-param": "lora" }, h("legend", { text: "LoRA adapter" }), h("div", { class: "grid" }, ...loraFields), h("p", { class: "field-error", role: "alert" })),
    h("fieldset", { "data-param": "optimizations" }, h("legend", { text: "Optimizations" }), h("p", { class: "help", text: "auto lets the trainer decide from the hardware it finds (the job page shows each decision and why); on fails the job early if it cannot run; off forces the plain path, for A/B comparisons." }), switches),
    h("fieldset", {}, h("legend", { text: "Evaluation" }), samplePrompts),
    formError,
    panel.element,
    h("div", { class: "actions" }, preview, submit),
  );

  preview.addEventListener("click", async () => {
    clearErrors(form, formError);
    panel.hide();
    let body;
    try {
      body = buildBody(form, model, train, valid, lengthUnit, lengthValue);
    } catch (err) {
      showErrors(form, formError, err);
      return;
    }
    preview.disabled = true;
    try {
      panel.show(await api("/v1/jobs/preview", { method: "POST", json: body, signal: controller.signal }));
    } catch (err) {
      if (err.name !== "AbortError") showErrors(form, formError, err);
    } finally {
      preview.disabled = false;
    }
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form, formError);
    let body;
    try {
      body = buildBody(form, model, train, valid, lengthUnit, lengthValue);
    } catch (err) {
      showErrors(form, formError, err);
      return;
    }
    submit.disabled = true;
    submit.textContent = "Submitting…";
    try {
      const job = await api("/v1/jobs", { method: "POST", json: body, signal: controller.signal });
      window.location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
    } catch (err) {
      if (err.name === "AbortError") return;
      showErrors(form, formError, err);
    } finally {
      submit.disabled = false;
      submit.textContent = "Submit job";
    }
  });

  clear(main, h("div", { class: "view-head" }, h("h1", { text: "New job" })), form);
  return () => controller.abort();
}

/** A labelled input with help text and a slot for its error; the input gets data-param. */
function field(param, label, input, help = null) {
  const id = uid("f");
  input.id = id;
  input.dataset.param = param;
  input.setAttribute("data-testid", `field-${param}`);
  const helpEl = help ? h("p", { class: "help", id: `${id}-help`, text: help }) : null;
  if (helpEl) input.setAttribute("aria-describedby", helpEl.id);
  return h("div", { class: "field" }, h("label", { for: id, text: label }), input, helpEl, h("p", { class: "field-error", role: "alert" }));
}

/**
 * How many GPUs the job runs on (one rank each, on one worker host): 1 up to the
 * largest live host's GPU count, which /v1/hardware tells; the help names it.
 */
function gpusField(signal) {
  const input = h("input", { type: "number", value: "1", min: "1", step: "1" });
  const element = field("gpus", "GPUs", input, "GPUs of one worker host the job runs on, one rank each; each step takes GPUs x gradient accumulation micro-batches.");
  api("/v1/hardware", { signal })
    .then((workers) => {
      const live = workers.data.filter((w) => w.alive && (w.gpus || []).length);
      if (!live.length) return;
      const largest = live.reduce((a, b) => (b.gpus.length > a.gpus.length ? b : a));
      input.max = String(largest.gpus.length);
      const help = element.querySelector(".help");
      help.dataset.testid = "gpus-help";
      help.textContent = `1 to ${largest.gpus.length} (${largest.id} has the most: ${largest.gpus.length}); one rank per GPU, all on one worker host. Each step takes GPUs x gradient accumulation micro-batches.`;
    })
    .catch(() => {}); // the field works without the hint; the API refuses a count no host has
  return element;
}

/**
 * The job spec's optimization switches, from the API's OpenAPI schema:
 * [{key, title, description, values, value}] in the trainer's order.
 */
function loadSwitches() {
  if (!switchList) {
    switchList = api("/openapi.json").then((schema) => {
      const properties = schema?.components?.schemas?.[SWITCH_SCHEMA]?.properties;
      if (!properties) throw new Error(`the API's schema has no ${SWITCH_SCHEMA}; the form cannot offer the switches`);
      return Object.entries(properties).map(([key, p]) => ({
        key,
        title: p.title || key,
        description: p.description || "",
        values: p.enum || ["auto", "on", "off"],
        value: p.default ?? "auto",
      }));
    });
    switchList.catch(() => {
      switchList = null; // try again next time the form opens
    });
  }
  return switchList;
}

/**
 * From the job spec's OpenAPI schema: param ("hyperparameters.warmup_steps") -> the API's
 * default (`defaults`), and -> the values a field takes, where the schema lists them (`choices`).
 */
function loadDefaults() {
  return api("/openapi.json").then((schema) => {
    const schemas = schema?.components?.schemas || {};
    const defaults = {};
    const choices = {};
    const job = schemas.JobSpec?.properties || {};
    const titles = job.objective?.["x-titles"] || {};
    // an objective's settings: the job spec's field named after it (a $ref to e.g. DpoSpec)
    const sectionOf = (name) => (job[name]?.$ref || "").split("/").pop();
    const objectiveNames = job.objective?.enum || [];
    const groups = [["", "JobSpec"], ["hyperparameters.", "Hyperparameters"], ["lora.", "LoraSpec"],
      ...objectiveNames.filter(sectionOf).map((name) => [`${name}.`, sectionOf(name)])];
    for (const [prefix, name] of groups) {
      for (const [key, p] of Object.entries(schemas[name]?.properties || {})) {
        if (p.default !== undefined && p.default !== null && typeof p.default !== "object") defaults[prefix + key] = p.default;
        else if (Array.isArray(p.default)) defaults[prefix + key] = p.default.join(", ");
        if (Array.isArray(p.enum)) choices[prefix + key] = p.enum;
      }
    }
    const sections = objectiveNames.filter(sectionOf).flatMap((name) =>
      Object.entries(schemas[sectionOf(name)]?.properties || {}).map(([key, p]) => ({
        objective: name,
        param: `${name}.${key}`,
        label: `${titles[name] || name} ${(p.title || key).toLowerCase()}`,
        help: `${titles[name] || name} only: ${p.description || ""}`,
      })));
    return { defaults, choices, titles, sections };
  });
}

function showDefaults(fields, { defaults, choices }) {
  for (const wrap of fields) {
    const input = wrap.querySelector("[data-param]");
    const param = input?.dataset.param;
    if (input?.tagName === "SELECT" && choices[param]) clear(input, choices[param].map((v) => h("option", { value: v, text: v })));
    const value = defaults[param];
    if (value === undefined) continue;
    if (input.tagName === "SELECT") input.value = String(value);
    else input.placeholder = String(value);
  }
}

function switchField({ key, title, description, values, value: initial }) {
  const param = `optimizations.${key}`;
  const options = values.map((value) => {
    const id = uid("sw");
    return h(
      "span",
      { class: "radio" },
      h("input", { type: "radio", id, name: param, value, checked: value === initial, "data-testid": `opt-${key}-${value}` }),
      h("label", { for: id, text: value }),
    );
  });
  return h(
    "fieldset",
    { class: "switch", "data-param": param, "data-testid": "switch" },
    h("legend", {}, h("span", { class: "mono", text: key }), ` — ${title}`),
    h("div", { class: "radios" }, options),
    h("p", { class: "help", text: description }),
    h("p", { class: "field-error", role: "alert" }),
  );
}

function modelPicker(signal) {
  const selectId = uid("model");
  const select = h("select", { id: selectId, "data-param": "model", "data-testid": "model-select", required: true });
  const otherId = uid("model-other");
  const other = h("input", { id: otherId, type: "text", placeholder: "org/name (hub id) or a path under the model root", "data-testid": "model-other" });
  const otherField = h("div", { class: "field", hidden: true }, h("label", { for: otherId, text: "Model name" }), other);
  const info = h("p", { class: "help", "data-testid": "model-info", "aria-live": "polite", text: "Loading the models on this box…" });
  let models = [];

  function describe() {
    const picked = models.find((m) => m.id === select.value);
    otherField.hidden = select.value !== "__other__";
    if (!picked) {
      info.textContent = select.value === "__other__" ? "A hub id needs the model in the box's Hugging Face cache when it is offline." : "";
      return;
    }
    const parts = [picked.architectures.join(", ") || picked.model_type || "unknown architecture"];
    if (picked.params !== null) parts.push(`${fmtCompact(picked.params)} parameters`);
    parts.push(`${fmtBytes(picked.bytes)} on disk`);
    info.textContent = parts.join(" · ") + (picked.error ? ` · warning: ${picked.error}` : "");
  }
  select.addEventListener("change", describe);
  const listeners = [];
  const notify = () => listeners.forEach((fn) => fn());
  select.addEventListener("change", notify);
  other.addEventListener("change", notify);

  api("/v1/models", { signal })
    .then((list) => {
      models = list.data;
      select.replaceChildren(
        ...models.map((m) => h("option", { value: m.id, text: `${m.id}${m.model_type ? ` (${m.model_type}${m.params !== null ? `, ${fmtCompact(m.params)}` : ""})` : ""}` })),
        h("option", { value: "__other__", text: "Another model (hub id or path)…" }),
      );
      if (!models.length) {
        select.value = "__other__";
        describe();
        info.textContent = `No models under ${list.model_root} yet: copy a Hugging Face model directory (with config.json) there, or name a hub id.`;
      } else {
        describe();
      }
      notify();
    })
    .catch((err) => {
      if (err.name === "AbortError") return;
      select.replaceChildren(h("option", { value: "__other__", text: "Another model (hub id or path)…" }));
      describe();
      info.textContent = `Could not list the models: ${err.message}`;
    });

  const element = h(
    "div",
    {},
    h("div", { class: "field" }, h("label", { for: selectId, text: "Base model" }), select, info, h("p", { class: "field-error", role: "alert" })),
    otherField,
  );
  return {
    element,
    value() {
      return select.value === "__other__" ? other.value.trim() : select.value;
    },
    onChange(fn) {
      listeners.push(fn);
    },
  };
}

/**
 * Upload-or-choose widget for one dataset. Uploading validates at once: the
 * answer is shown here (records, format, stats), or the API's message plus the
 * offending line read back from the local file.
 */
function datasetPicker({ purpose, label, param, required, signal, tokenContext }) {
  const inputId = uid(`${purpose}-file`);
  const input = h("input", { id: inputId, type: "file", accept: ".jsonl,.json,.txt,application/jsonl,application/json,text/plain", "data-testid": `upload-${purpose}` });
  const chooseId = uid(`${purpose}-choose`);
  const choose = h("select", { id: chooseId, "data-testid": `choose-${purpose}` }, h("option", { value: "", text: required ? "— upload a file above —" : "— none —" }));
  const result = h("div", { class: "upload-result", "data-testid": `upload-result-${purpose}`, "aria-live": "polite" });
  let fileId = null;
  const known = new Map();
  let tokenRequest = 0;

  /** Token statistics of the accepted file under the picked model, tokenized as training does. */
  async function refreshTokens() {
    const request = ++tokenRequest;
    result.querySelector('[data-testid="dataset-token-stats"]')?.remove();
    const modelName = tokenContext.model();
    if (!fileId || result.dataset.state !== "ok" || !modelName) return;
    const line = h("p", { class: "help", "data-testid": "dataset-token-stats", "data-state": "loading", text: `Counting tokens with ${modelName}'s tokenizer…` });
    result.append(line);
    const params = new URLSearchParams({ model: modelName });
    const maxSeqLen = Number.parseInt(tokenContext.maxSeqLen() || "", 10);
    if (maxSeqLen > 0) params.set("max_seq_len", String(maxSeqLen));
    try {
      const s = await api(`/v1/files/${encodeURIComponent(fileId)}/tokens?${params}`, { signal });
      if (request !== tokenRequest) return;
      const t = s.tokens;
      const over = s.over_max_seq_len;
      line.textContent =
        `${plural(s.records, "record")} · ${t.total.toLocaleString()} tokens (${t.min}/${t.mean}/${t.max} per record) · ` +
        `${s.loss_tokens.total.toLocaleString()} loss tokens · ${over.records} longer than max_seq_len ${over.max_seq_len}` +
        (s.note ? ` (${s.note})` : "");
      line.dataset.state = "ok";
    } catch (err) {
      if (err.name === "AbortError" || request !== tokenRequest) return;
      line.textContent = `Could not count tokens with ${modelName}: ${err.message}`;
      line.dataset.state = "error";
    }
  }

  function showAccepted(file, heading) {
    const stats = file.stats || {};
    const chars = stats.chars_per_record;
    clear(
      result,
      h("p", { class: "ok" }, h("strong", { text: `${heading} ${file.filename}` }), `: ${plural(file.num_records, "record")}, format ${file.format}${file.stats?.converted_from ? ` (converted from ${file.stats.converted_from})` : ""}, ${fmtBytes(file.bytes)}.`),
      h(
        "ul",
        { class: "stats" },
        chars ? h("li", { text: `Characters per record: min ${chars.min}, mean ${chars.mean}, max ${chars.max}` }) : null,
        stats.total_chars !== undefined ? h("li", { text: `Total characters: ${stats.total_chars.toLocaleString()}` }) : null,
        stats.messages_per_record_mean !== undefined ? h("li", { text: `Messages per record (mean): ${stats.messages_per_record_mean}` }) : null,
        h("li", { class: "mono", text: `${file.id} · sha256 ${file.sha256.slice(0, 16)}…` }),
      ),
    );
    result.dataset.state = "ok";
    result.dataset.fileId = file.id;
    refreshTokens();
  }

  async function refreshChoices(selected) {
    try {
      const inProject = selectedProject() ? `&project=${encodeURIComponent(selectedProject())}` : "";
      const page = await api(`/v1/files?purpose=${purpose}&limit=100${inProject}`, { signal });
      for (const f of page.data) known.set(f.id, f);
      choose.replaceChildren(
        h("option", { value: "", text: required ? "— choose an uploaded file —" : "— none —" }),
        ...page.data.map((f) => h("option", { value: f.id, text: `${f.filename} (${plural(f.num_records, "record")}, ${f.format}) · ${f.id}` })),
      );
      choose.value = selected || "";
    } catch (err) {
      if (err.name !== "AbortError") choose.title = `Could not list uploaded files: ${err.message}`;
    }
  }

  input.addEventListener("change", async () => {
    const file = input.files[0];
    if (!file) return;
    fileId = null;
    choose.value = "";
    result.dataset.state = "busy";
    delete result.dataset.fileId;
    clear(result, h("p", { class: "muted", text: `Uploading and checking ${file.name} (${fmtBytes(file.size)})…` }));
    const form = new FormData();
    form.append("purpose", purpose);
    if (selectedProject()) form.append("project", selectedProject());
    form.append("file", file, file.name);
    try {
      const stored = await api("/v1/files", { method: "POST", body: form, signal });
      fileId = stored.id;
      known.set(stored.id, stored);
      showAccepted(stored, "Accepted");
      await refreshChoices(stored.id);
    } catch (err) {
      if (err.name === "AbortError") return;
      result.dataset.state = "error";
      clear(result, h("p", { class: "bad", role: "alert", "data-testid": `upload-error-${purpose}`, text: `Refused ${file.name}: ${err.message}` }));
      if (err instanceof ApiError && err.line) {
        result.dataset.line = String(err.line);
        const text = await badLine(file, err.line);
        if (text !== null) {
          result.append(
            h("p", { class: "help", text: `Line ${err.line} of ${file.name}:` }),
            h("pre", { class: "bad-line", "data-testid": `upload-bad-line-${purpose}`, text: text === "" ? "(empty line)" : text }),
          );
        }
      }
      input.value = "";
    }
  });

  choose.addEventListener("change", () => {
    fileId = choose.value || null;
    const f = known.get(fileId);
    if (f) showAccepted(f, "Using");
    else {
      clear(result);
      delete result.dataset.state;
    }
  });

  refreshChoices(null);
  const element = h(
    "div",
    { class: "dataset", "data-param": param },
    h("h3", { text: label }),
    h(
      "div",
      { class: "grid" },
      h("div", { class: "field" }, h("label", { for: inputId, text: "Upload a JSONL file" }), input, h("p", { class: "help", text: 'One JSON object per line: {"messages": [...]}, {"prompt", "completion"} or {"text"}.' })),
      h("div", { class: "field" }, h("label", { for: chooseId, text: "or use an uploaded file" }), choose),
    ),
    result,
    h("p", { class: "field-error", role: "alert" }),
  );
  return { element, value: () => fileId, refreshTokens };
}

/** Line ``number`` (1-based) of a local file, cut to 500 characters; null if out of reach. */
async function badLine(file, number) {
  try {
    const text = await file.slice(0, MAX_BAD_LINE_SCAN).text();
    const lines = text.split(/\r?\n/);
    if (number < 1 || number > lines.length) return null;
    const line = lines[number - 1];
    return line.length > 500 ? `${line.slice(0, 500)}… (${line.length} characters)` : line;
  } catch {
    return null;
  }
}

class FormProblem extends Error {
  constructor(param, message) {
    super(message);
    this.param = param;
    this.details = [{ param, message }];
  }
}

function buildBody(form, model, train, valid, lengthUnit, lengthValue) {
  const modelName = model.value();
  if (!modelName) throw new FormProblem("model", "model: pick a model, or type a hub id");
  const trainingFile = train.value();
  if (!trainingFile) throw new FormProblem("training_file", "training_file: upload a training dataset or choose an uploaded one");
  const body = { model: modelName, training_file: trainingFile, hyperparameters: {}, lora: {}, optimizations: {} };
  if (selectedProject()) body.project = selectedProject();
  const validation = valid.value();
  if (validation) body.validation_file = validation;

  for (const el of form.querySelectorAll("input[data-param], select[data-param]")) {
    const param = el.dataset.param;
    if (param === "model" || el.type === "file") continue;
    const raw = el.value.trim();
    if (raw === "") continue;
    let value = raw;
    if (el.type === "number") {
      value = Number(raw);
      if (!Number.isFinite(value)) throw new FormProblem(param, `${param}: ${raw} is not a number`);
    }
    if (param === "lora.target_modules") value = raw.split(",").map((s) => s.trim()).filter(Boolean);
    setPath(body, param, value);
  }
  for (const radio of form.querySelectorAll("input[type=radio]:checked")) setPath(body, radio.name, radio.value);
  const prompts = form.querySelector('textarea[data-param="sample_prompts"]')?.value.split("\n").map((s) => s.trim()).filter(Boolean);
  if (prompts?.length) body.sample_prompts = prompts;
  // the settings of an objective other than the chosen one (their fields are hidden) are left out
  for (const other of form.querySelector('select[data-param="objective"]')?.options || []) {
    if (other.value !== body.objective) delete body[other.value];
  }
  if (lengthUnit.value === "epochs") delete body.hyperparameters.max_steps;
  else delete body.hyperparameters.epochs;
  return body;
}

function setPath(obj, path, value) {
  const keys = path.split(".");
  let node = obj;
  for (const key of keys.slice(0, -1)) node = node[key] ??= {};
  node[keys[keys.length - 1]] = value;
}

function clearErrors(form, formError) {
  clear(formError);
  for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
  for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
}

/** Put each problem next to the input (or group) its param names; the summary goes above the button. */
function showErrors(form, formError, err) {
  const details = err.details?.length ? err.details : [{ param: err.param, message: err.message }];
  let first = null;
  for (const { param, message } of details) {
    const target = param ? locate(form, param) : null;
    if (!target) continue;
    const group = target.closest(".field, fieldset, .dataset");
    const slot = group?.querySelector(":scope > .field-error") ?? group?.querySelector(".field-error");
    if (slot) slot.textContent = slot.textContent ? `${slot.textContent} ${message}` : message;
    if (target.matches("input, select")) target.setAttribute("aria-invalid", "true");
    first ??= target;
  }
  clear(formError, errorBox(err, "submit-error"));
  (first?.matches("input, select") ? first : formError.firstChild)?.focus?.();
}

/** The element for an API param: the exact input, else the closest enclosing group. */
function locate(form, param) {
  let path = param;
  while (path) {
    const el = form.querySelector(`[data-param="${CSS.escape(path)}"]`) || form.querySelector(`input[name="${CSS.escape(path)}"]`);
    if (el) return el;
    path = path.includes(".") ? path.slice(0, path.lastIndexOf(".")) : "";
  }
  return null;
}

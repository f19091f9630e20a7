// The playground: a conversation with one or two models at once, their answers streaming side by side.
//
//   #/playground[?job=<id>]   (the job page's "Try it" preselects that job's tuned model)
//
// Pick a base or a tuned model (a job's final adapter or one of its checkpoints: GET /openai/v1/models)
// for each column, a system prompt and the sampling parameters; Send posts each column's conversation
// so far (system prompt, every earlier message and that column's own answers, the new message last) to
// POST /openai/v1/chat/completions (stream: true) for each column at once and shows each answer as
// it streams, with its time to first token and tokens/s (the usage chunk's completion tokens over
// the time from the first token to the last). "New conversation", or another model in a column,
// starts that column over. The first request for a model starts its chat session on a worker
// (docs/sessions.md): a 503 while it loads is retried after its Retry-After.

import { api, selectedProject } from "./api.js";
import { h, clear, errorBox } from "./dom.js";

const CSRF_HEADER = { "X-Requested-With": "ftq-dashboard" };
const LOAD_WAIT_MS = 10 * 60 * 1000;

/** The view; returns its cleanup (aborts the streams). */
export function renderPlayground(main, _params, query) {
  const controller = new AbortController();
  const pickers = [modelPicker("playground-model-a", false), modelPicker("playground-model-b", true)];
  const system = h("textarea", { rows: 2, "data-testid": "playground-system", placeholder: "You are a helpful assistant." });
  const message = h("textarea", { rows: 3, "data-testid": "playground-message", placeholder: "Ask something" });
  const temperature = numberInput("playground-temperature", "0.7", "0", "2", "0.1");
  const maxTokens = numberInput("playground-max-tokens", "256", "1", "32768", "1");
  const seed = numberInput("playground-seed", "", "0", null, "1");
  const columns = h("div", { class: "playground-columns", "data-testid": "playground-answers" });
  const problem = h("div");
  const send = h("button", { type: "submit", "data-testid": "playground-send", text: "Send" });
  const restart = h("button", { type: "button", "data-testid": "playground-new", text: "New conversation", on: { click: () => startOver() } });
  let conversations = [null, null]; // per column: { model, turns: [{role, content}], pane }

  clear(
    main,
    h("h1", { text: "Playground" }),
    h("p", { class: "muted", text: "The first message to a model starts a chat session for it on a GPU (it loads once, then answers at once until it idles out). Each column keeps its own conversation." }),
    h(
      "form",
      { class: "playground-form", on: { submit: (e) => { e.preventDefault(); run(); } } },
      h("div", { class: "playground-models" }, pickers.map((p) => p.label)),
      h("label", {}, "System prompt", system),
      h("div", { class: "playground-params" },
        h("label", {}, "Temperature", temperature), h("label", {}, "Max tokens", maxTokens), h("label", {}, "Seed", seed)),
      h("label", {}, "Message", message),
      h("div", { class: "playground-actions" }, send, restart),
    ),
    problem,
    columns,
  );

  loadModels(pickers, query.get("job"), controller.signal).catch((err) => {
    if (err.name !== "AbortError") clear(problem, errorBox(err, "playground-error"));
  });

  function startOver() {
    conversations = [null, null];
    clear(columns);
    clear(problem);
  }

  async function run() {
    clear(problem);
    const chosen = pickers.map((p) => p.select.value);
    if (!chosen.some(Boolean) || !message.value.trim()) {
      clear(problem, h("p", { class: "error", text: "Pick a model and write a message." }));
      return;
    }
    // a column whose model changed (or was emptied) starts over
    conversations = conversations.map((c, i) => (c && c.model === chosen[i] ? c : chosen[i] ? newConversation(chosen[i], i) : null));
    clear(columns, conversations.filter(Boolean).map((c) => c.pane.element));
    const text = message.value;
    const prefix = system.value.trim() ? [{ role: "system", content: system.value }] : [];
    const sampling = { stream: true, stream_options: { include_usage: true }, temperature: Number(temperature.value), max_tokens: Number(maxTokens.value) };
    if (seed.value !== "") sampling.seed = Number(seed.value);
    send.disabled = restart.disabled = true;
    message.value = "";
    await Promise.all(conversations.filter(Boolean).map(async (c) => {
      const turn = c.pane.addTurn(text);
      const messages = [...prefix, ...c.turns, { role: "user", content: text }];
      const answer = await stream({ ...sampling, model: c.model, messages }, turn, controller.signal);
      if (answer !== null) c.turns.push({ role: "user", content: text }, { role: "assistant", content: answer });
    }));
    send.disabled = restart.disabled = false;
  }

  return () => controller.abort();
}

function newConversation(model, index) {
  return { model, turns: [], pane: conversationPane(model, index) };
}

function modelPicker(testid, optional) {
  const select = h("select", { "data-testid": testid }, optional ? h("option", { value: "", text: "(none)" }) : null);
  const label = h("label", {}, optional ? "Second model (optional)" : "Model", select);
  return { select, label, optional };
}

function numberInput(testid, value, min, max, step) {
  return h("input", { type: "number", "data-testid": testid, value, min, max, step });
}

async function loadModels(pickers, jobId, signal) {
  const models = (await api("/openai/v1/models", { signal, headers: projectHeader() })).data.map((m) => m.id);
  for (const picker of pickers) {
    picker.select.append(...models.map((id) => h("option", { value: id, text: id })));
  }
  const wanted = jobId ? models.find((id) => id.startsWith("ft:") && id.endsWith(`:${jobId}`)) : null;
  if (wanted) {
    pickers[0].select.value = wanted;
    const base = wanted.split(":")[1];
    if (models.includes(base)) pickers[1].select.value = base; // the tuned model beside its base
  }
}

function projectHeader() {
  const project = selectedProject();
  return project ? { "OpenAI-Project": project } : {};
}

/** A column: its model's name and its turns; ``addTurn`` shows the user's message and an answer
 * box. The newest turn's answer and stats carry the column's test ids (``playground-text-<column>``,
 * ``playground-stats-<column>``); earlier ones keep theirs with the turn's number appended. */
function conversationPane(model, index) {
  const transcript = h("div", { class: "playground-transcript" });
  const element = h("section", { class: "playground-answer", "data-testid": `playground-answer-${index}` }, h("h2", { class: "mono", text: model }), transcript);
  let count = 0;
  let latest = null;
  function addTurn(text) {
    if (latest) {
      latest.text.dataset.testid = `playground-text-${index}-${count}`;
      latest.stats.dataset.testid = `playground-stats-${index}-${count}`;
    }
    count += 1;
    const said = h("div", { class: "playground-user", "data-testid": `playground-user-${index}-${count}`, text });
    const answer = h("div", { class: "playground-text", "data-testid": `playground-text-${index}` });
    const stats = h("p", { class: "muted", "data-testid": `playground-stats-${index}`, text: "waiting…" });
    transcript.append(h("div", { class: "playground-turn" }, said, answer, stats));
    latest = { text: answer, stats };
    return latest;
  }
  return { model, element, addTurn };
}

/** POST one streamed chat completion into ``pane``, retrying while its session loads; resolves to
 * the answer's text, or null when it failed (the turn is then left out of the conversation). */
async function stream(body, pane, signal) {
  const started = performance.now();
  const deadline = started + LOAD_WAIT_MS;
  for (;;) {
    let response;
    try {
      response = await fetch("/openai/v1/chat/completions", {
        method: "POST", signal, body: JSON.stringify(body),
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...CSRF_HEADER, ...projectHeader() },
      });
    } catch (err) {
      if (err.name !== "AbortError") pane.stats.textContent = `the API is not reachable (${err.message})`;
      return null;
    }
    if (response.status === 503 && performance.now() < deadline) {
      const pause = Number(response.headers.get("Retry-After") || "5");
      pane.stats.textContent = "the model is loading in a new session…";
      await new Promise((resolve) => setTimeout(resolve, pause * 1000));
      continue;
    }
    if (!response.ok) {
      const error = (await response.json().catch(() => ({}))).error || {};
      pane.stats.textContent = `${response.status}: ${error.message || response.statusText}`;
      pane.stats.className = "error";
      return null;
    }
    return readStream(response, pane, performance.now());
  }
}

async function readStream(response, pane, sent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let first = null;
  let tokens = 0;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        pane.stats.textContent = chunk.error.message;
        pane.stats.className = "error";
        return null;
      }
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) {
        if (first === null) first = performance.now();
        pane.text.append(piece);
      }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
    }
  }
  const end = performance.now();
  const ttft = first === null ? null : first - sent;
  const rate = first !== null && end > first ? (tokens / ((end - first) / 1000)).toFixed(1) : "–";
  pane.stats.textContent = `${tokens} tokens · first token ${ttft === null ? "–" : Math.round(ttft) + " ms"} · ${rate} tokens/s`;
  pane.stats.dataset.tokens = String(tokens);
  return pane.text.textContent;
}

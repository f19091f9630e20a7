// A GRPO job's rollouts (docs/grpo.md, "Rollouts"): each step's first `grpo.log_rollouts`
// completions with their prompt, reward, advantage and each grader's score. A step selector lists
// the steps that showed rollouts (GET /v1/jobs/{id}/rollouts/steps); the chosen step's rollouts come
// from GET /v1/jobs/{id}/rollouts?step=N. While the job runs, each `rollouts` event adds its step;
// the newest is shown as it arrives unless another step was picked.

import { api } from "./api.js";
import { h, clear, errorBox, fmtNumber } from "./dom.js";

/** The section for job ``id`` (URL-encoded): ``update(job)`` shows it for a GRPO job, ``add(event)`` takes a live ``rollouts`` event. */
export function rolloutsSection(id, signal) {
  const select = h("select", { id: "rollouts-step", "data-testid": "rollouts-step" });
  const body = h("div", { "data-testid": "job-rollouts-body" });
  const element = h(
    "section",
    { "aria-labelledby": "rollouts-h", "data-testid": "job-rollouts", hidden: true },
    h("h2", { id: "rollouts-h", text: "Rollouts" }),
    h("div", { class: "toolbar" }, h("label", { for: "rollouts-step", text: "Step" }), select),
    body,
  );
  const shown = new Map(); // step -> rollouts: the steps looked at, and the newest received while following
  const known = new Set(); // the steps in the selector
  let last = -Infinity;
  let following = true; // show each new step as it comes, until the user picks another
  let started = false;

  select.addEventListener("change", () => {
    following = select.value === select.options[select.options.length - 1]?.value;
    show(Number(select.value));
  });

  function addStep(step) {
    if (known.has(step)) return;
    known.add(step);
    const option = h("option", { value: String(step), text: `step ${step}` });
    if (step > last) { // the usual case: steps come in order (a long run's history replays thousands)
      select.append(option);
      last = step;
    } else {
      select.insertBefore(option, [...select.options].find((o) => Number(o.value) > step) || null);
    }
  }

  async function show(step) {
    select.value = String(step);
    try {
      if (!shown.has(step)) {
        const page = await api(`/v1/jobs/${id}/rollouts?step=${step}`, { signal });
        shown.set(step, page.data[0]?.rollouts || []);
      }
      clear(body, rolloutsTable(step, shown.get(step)));
    } catch (err) {
      if (err.name !== "AbortError") clear(body, errorBox(err, "job-rollouts-error"));
    }
  }

  async function load() {
    try {
      const { steps } = await api(`/v1/jobs/${id}/rollouts/steps`, { signal });
      steps.forEach(addStep);
      if (!steps.length) {
        if (!select.options.length) clear(body, h("p", { class: "muted", text: "Each step's first rollouts appear here as the job trains." }));
        return;
      }
      if (following) await show(last);
    } catch (err) {
      if (err.name !== "AbortError") clear(body, errorBox(err, "job-rollouts-error"));
    }
  }

  function update(job) {
    if (job.spec?.objective !== "grpo") return;
    element.hidden = false;
    if (!started) {
      started = true;
      load();
    }
  }

  function add(event) {
    if (element.hidden || typeof event.step !== "number") return;
    addStep(event.step);
    if (!following || event.step < last) return; // another step is read when picked
    shown.set(event.step, event.rollouts || []);
    show(event.step);
  }

  return { element, update, add };
}

function rolloutsTable(step, rollouts) {
  if (!rollouts.length) return h("p", { class: "muted", text: `No rollouts shown for step ${step}.` });
  const rewards = rollouts.map((r) => r.reward);
  const mean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
  const scores = (r) => Object.entries(r.scores || {}).map(([k, v]) => `${k} ${fmtNumber(v, 3)}`).join(", ");
  return h(
    "div",
    { class: "table-wrap" },
    h("p", { class: "muted", "data-testid": "rollouts-caption", text: `Step ${step}: ${rollouts.length} rollouts shown, mean reward ${fmtNumber(mean, 3)} (the step's own, over every completion, is on the reward chart).` }),
    h(
      "table",
      { class: "table", "data-testid": "rollouts-table" },
      h("thead", {}, h("tr", {}, ["Prompt", "Completion", "Tokens", "Reward", "Advantage", "Graders"].map((t) => h("th", { scope: "col", text: t })))),
      h("tbody", {}, rollouts.map((r) => h(
        "tr",
        { "data-testid": "rollout-row", "data-prompt-index": String(r.prompt_index), "data-reward": String(r.reward) },
        h("td", { class: "pre", title: `prompt ${r.prompt_index}`, text: r.prompt }),
        h("td", { class: "pre", "data-testid": "rollout-completion", text: r.completion }),
        h("td", { class: "num", text: String(r.completion_tokens) }),
        h("td", { class: "num", "data-testid": "rollout-reward", text: fmtNumber(r.reward, 3) }),
        h("td", { class: "num", text: fmtNumber(r.advantage, 3) }),
        h("td", { "data-testid": "rollout-scores", text: scores(r) }),
      ))),
    ),
  );
}

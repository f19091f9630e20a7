// Login: paste an API key, the server answers with an HttpOnly session cookie
// (POST /v1/session). The key goes no further than that request: it is not
// kept in localStorage or anywhere else a page script could read it back.

import { login, ApiError } from "./api.js";
import { h, clear, errorBox } from "./dom.js";

export function renderLogin(main, _params, query) {
  const next = query.get("next") || "#/jobs";
  const input = h("input", {
    id: "api-key",
    type: "password",
    name: "api_key",
    autocomplete: "off",
    spellcheck: "false",
    required: true,
    placeholder: "ftq_…",
    "data-testid": "login-key",
  });
  const problem = h("div");
  const submit = h("button", { type: "submit", "data-testid": "login-submit", text: "Log in" });
  const form = h(
    "form",
    { class: "login", "data-testid": "login-form" },
    h("label", { for: "api-key", text: "API key" }),
    input,
    h(
      "p",
      { class: "muted" },
      "Your key starts with ftq_. An admin makes one with ",
      h("code", { text: "ftq users create NAME" }),
      "; on a box started with ",
      h("code", { text: "ftq up" }),
      " the first admin key was printed at its first start.",
    ),
    problem,
    submit,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    submit.disabled = true;
    clear(problem);
    try {
      await login(input.value.trim());
      input.value = "";
      window.dispatchEvent(new CustomEvent("ftq:login"));
      window.location.hash = next.startsWith("#/") && !next.startsWith("#/login") ? next : "#/jobs";
    } catch (err) {
      const shown = err instanceof ApiError && err.status === 401 ? new Error(err.message) : err;
      clear(problem, errorBox(shown, "login-error"));
    } finally {
      submit.disabled = false;
    }
  });
  clear(main, h("h1", { text: "Log in to ftq" }), form);
  input.focus();
  return null;
}

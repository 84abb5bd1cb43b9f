// The chat page: sends the conversation to this server's /v1/chat/completions with stream: true and
// shows the reply as its SSE deltas arrive: `reasoning_content` in a collapsed "Thinking" block,
// `content` as the answer. Plain text only (no markdown, no HTML from the model). Paths are relative,
// so the page also works behind a proxy that serves the server under a prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const els = {
  model: $("model"), newChat: $("new-chat"), system: $("system"), temperature: $("temperature"), topP: $("top_p"),
  maxTokens: $("max_tokens"), key: $("api-key"), extra: $("extra"), error: $("error"), messages: $("messages"),
  empty: $("empty"), form: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
};
const STORE = { key: "chitu.apiKey", model: "chitu.model", settings: "chitu.settings" };
const SAVED_SETTINGS = ["system", "temperature", "topP", "maxTokens", "extra"];

let history = [];       // the finished turns sent back with the next message: {role, content}
let controller = null;  // the AbortController of the request in flight, if any
let chat = 0;           // bumped by New chat, so a reply that ends after it is not added to the new history

class ServerError extends Error {}

function authHeaders() {
  const key = els.key.value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

/** The message of an error response: the server's OpenAI-shaped {"error": {"message"}}, else the status and body. */
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: fall through */ }
  return `HTTP ${response.status} ${response.statusText}` + (text ? ": " + text.slice(0, 300) : "");
}

function showError(message) {
  els.error.textContent = message || "";
  els.error.hidden = !message;
}

async function loadModels() {
  try {
    const response = await fetch("v1/models", { headers: authHeaders() });
    if (!response.ok) throw new ServerError(await errorMessage(response));
    const { data } = await response.json();
    const wanted = els.model.value || localStorage.getItem(STORE.model);
    els.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    if (data.some((m) => m.id === wanted)) els.model.value = wanted;
    showError("");
  } catch (e) {
    els.model.replaceChildren();
    showError("Could not list the models: " + e.message);
  }
}

/** The data of each server-sent event in a fetch body, as strings. */
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
      if (data) yield data;
    }
  }
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function addUserMessage(text) {
  const li = element("li", "msg user");
  li.append(element("p", "who", "You"), element("div", "content", text));
  els.messages.append(li);
  els.empty.hidden = true;
}

/** An assistant message being streamed, with setters for its parts. */
function addAssistantMessage(model) {
  const li = element("li", "msg assistant");
  const thinking = element("details", "thinking");
  const summary = element("summary", "", "Thinking…");
  const reasoning = element("div", "reasoning");
  const content = element("div", "content");
  const status = element("p", "status");
  thinking.append(summary, reasoning);
  thinking.hidden = true;
  li.append(element("p", "who", model || "Assistant"), thinking, content, status);
  els.messages.append(li);
  return {
    set state(value) { li.dataset.state = value; },
    reasoning(text) { thinking.hidden = false; reasoning.textContent = text; },
    thought(seconds) { summary.textContent = `Thought for ${seconds.toFixed(1)} s`; },
    content(text) { content.textContent = text; },
    status(text) { status.textContent = text; },
  };
}

function nearBottom() {
  return window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 80;
}

function following(update) {
  const follow = nearBottom();
  update();
  if (follow) window.scrollTo(0, document.documentElement.scrollHeight);
}

function number(input) {
  return input.value.trim() === "" ? undefined : Number(input.value);
}

/** The extra request fields, or null (with the error shown) when they are not a JSON object. */
function extraFields() {
  const text = els.extra.value.trim();
  if (!text) return {};
  try {
    const value = JSON.parse(text);
    if (value && typeof value === "object" && !Array.isArray(value)) return value;
  } catch (_) { /* reported below */ }
  showError("Extra request fields must be a JSON object, e.g. {\"top_k\": 40}; got: " + text.slice(0, 200));
  return null;
}

function setBusy(busy) {
  els.send.disabled = busy;
  els.stop.disabled = !busy;
  els.messages.setAttribute("aria-busy", String(busy));
}

async function send(text) {
  const extra = extraFields();
  if (extra === null) return;
  const user = { role: "user", content: text };
  const system = els.system.value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history, user];
  const body = {
    model: els.model.value, temperature: number(els.temperature), top_p: number(els.topP),
    max_tokens: number(els.maxTokens), ...extra, messages, stream: true, stream_options: { include_usage: true },
  };
  const mine = chat;
  showError("");
  els.input.value = "";
  addUserMessage(text);
  const reply = addAssistantMessage(body.model);
  reply.state = "streaming";
  setBusy(true);
  controller = new AbortController();
  const started = performance.now();
  let content = "", reasoning = "", finish = null, usage = null, done = false, thoughtAt = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await errorMessage(response));
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") { done = true; break; }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      following(() => {
        if (delta.reasoning_content) reply.reasoning(reasoning += delta.reasoning_content);
        if (delta.content) {
          if (reasoning && thoughtAt === null) reply.thought(((thoughtAt = performance.now()) - started) / 1000);
          reply.content(content += delta.content);
        }
      });
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (!done) throw new ServerError("the connection closed before the reply finished");
    reply.state = "done";
    const seconds = (performance.now() - started) / 1000;
    if (reasoning && thoughtAt === null) reply.thought(seconds);  // it only thought
    const tokens = usage ? `${usage.completion_tokens} tokens · ${(usage.completion_tokens / seconds).toFixed(1)} tokens/s` : "";
    reply.status([tokens, finish === "length" ? "reached max tokens" : ""].filter(Boolean).join(" · "));
    if (mine === chat) history.push(user, { role: "assistant", content });
  } catch (e) {
    if (e.name === "AbortError") {
      reply.state = "stopped";
      reply.status("Stopped");
      if (mine === chat) history.push(user, { role: "assistant", content });
    } else {
      const message = e instanceof ServerError ? e.message : `${e.name}: ${e.message}`;
      reply.state = "error";
      reply.status("Error: " + message);
      showError(message);
      if (!els.input.value) els.input.value = text;  // the message is not in the history: let it be sent again
    }
  } finally {
    if (mine === chat) {
      controller = null;
      setBusy(false);
    }
  }
}

function stop() {
  if (controller) controller.abort();
  els.input.focus();
}

function newChat() {
  stop();
  controller = null;
  chat += 1;
  history = [];
  setBusy(false);
  els.messages.replaceChildren();
  els.empty.hidden = false;
  showError("");
  els.input.value = "";
  els.input.focus();
}

function restoreSettings() {
  els.key.value = localStorage.getItem(STORE.key) || "";
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(STORE.settings) || "{}"); } catch (_) { /* start afresh */ }
  for (const name of SAVED_SETTINGS) if (typeof saved[name] === "string") els[name].value = saved[name];
}

function saveSettings() {
  const saved = {};
  for (const name of SAVED_SETTINGS) saved[name] = els[name].value;
  localStorage.setItem(STORE.settings, JSON.stringify(saved));
}

els.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = els.input.value;
  if (controller || !text.trim()) return;
  send(text);
});
els.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.ctrlKey && !event.altKey && !event.metaKey && !event.isComposing) {
    event.preventDefault();  // Enter sends; Shift+Enter (and an IME's Enter) keep their newline
    els.form.requestSubmit();
  } else if (event.key === "Escape" && controller) {
    stop();
  }
});
els.stop.addEventListener("click", stop);
els.newChat.addEventListener("click", newChat);
els.model.addEventListener("change", () => localStorage.setItem(STORE.model, els.model.value));
els.key.addEventListener("change", () => {
  const key = els.key.value.trim();
  if (key) localStorage.setItem(STORE.key, key); else localStorage.removeItem(STORE.key);
  loadModels();
});
for (const name of SAVED_SETTINGS) els[name].addEventListener("change", saveSettings);

restoreSettings();
loadModels();

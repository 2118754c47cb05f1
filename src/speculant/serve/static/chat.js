// speculant's chat page: one conversation with the served model over /v1/chat/completions,
// streamed; each token is coloured by where it came from (an accepted draft or the target's own
// token: the request's extension speculative.sources), with tokens/s and tokens per target pass
// (tau) shown live and the server's own figures (usage.speculative) at the end. A thinking model's
// thinking (delta.reasoning_content) is shown muted before its answer and is not sent back.
"use strict";

const $ = (id) => document.getElementById(id);
const messages = [];
let modelId = "default";
let aborter = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function connect() {
  try {
    const health = await (await fetch("/health")).json();
    const models = await fetch("/v1/models", { headers: headers() });
    if (models.ok) modelId = (await models.json()).data[0].id;
    $("model").textContent = `${modelId} · ${health.method}`;
  } catch (e) {
    $("model").textContent = "the server does not answer: " + e;
  }
}

function bubble(who, cls) {
  const div = document.createElement("div");
  div.className = "msg " + (cls || "");
  const name = document.createElement("span");
  name.className = "who";
  name.textContent = who;
  div.appendChild(name);
  const body = document.createElement("span");
  body.className = "body";
  div.appendChild(body);
  $("log").appendChild(div);
  return body;
}

function request(stream) {
  const body = {
    model: modelId,
    messages: ($("system").value.trim() ? [{ role: "system", content: $("system").value }] : []).concat(messages),
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
    stream: stream,
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (!$("speculate").checked) body.speculative = false;
  else {
    body.speculative = { sources: true };
    if ($("max_depth").value !== "") body.speculative.max_depth = Number($("max_depth").value);
  }
  return body;
}

function showLive(tokens, targets, started) {
  const seconds = (performance.now() - started) / 1000;
  const rate = seconds > 0 ? tokens / seconds : 0;
  const tau = targets > 0 ? tokens / targets : 0;
  $("live").textContent = `${tokens} tokens · ${rate.toFixed(1)} tok/s · τ ${tau.toFixed(2)}`;
}

function showSummary(usage, tokens, started) {
  const spec = usage.speculative || {};
  const rows = {
    "tokens": usage.completion_tokens,
    "tok/s": (tokens / ((performance.now() - started) / 1000)).toFixed(1),
    "τ (server)": Number(spec.tokens_per_call || 0).toFixed(2),
    "acceptance": Number(spec.acceptance_rate || 0).toFixed(2),
    "target passes": spec.target_calls,
    "method": spec.method,
  };
  const dl = $("summary");
  dl.replaceChildren();
  for (const [k, v] of Object.entries(rows)) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = String(v);
    dd.dataset.key = k;
    dl.append(dt, dd);
  }
}

async function send(text) {
  messages.push({ role: "user", content: text });
  bubble("you").textContent = text;
  const out = bubble("assistant");
  $("send").disabled = true;
  $("stop").disabled = false;
  aborter = new AbortController();
  let answer = "", tokens = 0, targets = 0;
  const sourced = $("speculate").checked;
  const started = performance.now();
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request(true)), signal: aborter.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({ error: { message: res.statusText } }));
      throw new Error(err.error.message);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) { showSummary(chunk.usage, tokens, started); continue; }
        const choice = chunk.choices[0];
        if (!choice || choice.finish_reason) continue;
        const piece = (choice.delta && choice.delta.content) || "";
        const thought = (choice.delta && choice.delta.reasoning_content) || "";
        // with sources, a token's first chunk names its source (a token may have a second: its answer's start)
        if (sourced ? choice.source !== undefined : Boolean(piece || thought)) {
          tokens += 1;
          if (choice.source !== "draft") targets += 1;
        }
        if (piece || thought) {
          const span = document.createElement("span");
          span.className = (choice.source === "draft" ? "draft" : "target") + (thought ? " thought" : "");
          span.textContent = thought || piece;
          const last = out.lastElementChild;
          if (piece && last && last.classList.contains("thought")) out.appendChild(document.createTextNode("\n\n"));
          out.appendChild(span);
          answer += piece;
        }
        showLive(tokens, targets, started);
      }
    }
    messages.push({ role: "assistant", content: answer });
  } catch (e) {
    if (e.name !== "AbortError") {
      out.parentElement.classList.add("error");
      out.appendChild(document.createTextNode((answer ? "\n" : "") + e.message));
    } else if (answer) {
      messages.push({ role: "assistant", content: answer });
    }
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    aborter = null;
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim()) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => aborter && aborter.abort());
$("clear").addEventListener("click", () => {
  messages.length = 0;
  $("log").replaceChildren();
  $("summary").replaceChildren();
  $("live").textContent = "";
});
$("api_key").addEventListener("change", connect);
connect();

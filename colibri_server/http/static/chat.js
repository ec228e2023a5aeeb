"use strict";
// The chat page: messages streamed from /v1/chat/completions (server-sent events). Stop aborts the
// fetch: the gateway sees the connection close and cancels the request at the router.
(() => {
  const $ = (id) => document.getElementById(id);
  const history = [];           // {role, content} of the finished turns
  let model = null;
  let controller = null;

  async function loadModel() {
    try {
      const r = await colibri.call("/v1/models");
      if (!r.ok) throw new Error(await colibri.errorText(r));
      const m = (await r.json()).data[0];
      model = m.id;
      const ctx = m.max_model_len;
      $("model").textContent = m.id + (ctx ? " · context " + ctx + " tokens" : "");
      $("model").dataset.context = ctx || "";
      if (ctx) $("max_tokens").value = Math.max(1, Math.min(512, Math.floor(ctx / 2)));
    } catch (e) {
      $("model").textContent = "model unknown: " + e.message;
      $("model").classList.add("error");
      setTimeout(loadModel, 3000);      // starting, or unreachable: ask again
    }
  }

  function bubble(role, text) {
    const div = colibri.el("div", "msg " + role);
    div.appendChild(colibri.el("div", "role", role));
    const body = colibri.el("div", "body");
    if (role === "user") body.textContent = text; else body.innerHTML = markdown.render(text || "");
    div.appendChild(body);
    div.appendChild(colibri.el("div", "meta"));
    $("messages").appendChild(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  function num(id) {
    const v = $(id).value.trim();
    return v === "" ? undefined : Number(v);
  }

  function requestBody() {
    const messages = [];
    const sys = $("system").value.trim();
    if (sys) messages.push({ role: "system", content: sys });
    const body = { messages: messages.concat(history), stream: true, stream_options: { include_usage: true } };
    if (model) body.model = model;
    for (const k of ["temperature", "top_p", "max_tokens"]) {
      const v = num(k);
      if (v !== undefined) body[k] = v;
    }
    const stop = $("stop").value.split("\n").filter((s) => s.length);
    if (stop.length) body.stop = stop;
    return body;
  }

  function busy(on) {
    $("send").disabled = on;
    $("stopbtn").disabled = !on;
  }

  // the events of an SSE body: each `data: ...` payload, in order
  async function* events(response) {
    const reader = response.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        const data = ev.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (data) yield data;
      }
    }
  }

  async function send(text) {
    history.push({ role: "user", content: text });
    bubble("user", text);
    const div = bubble("assistant", "");
    const body = div.querySelector(".body");
    const meta = div.querySelector(".meta");
    let answer = "";
    let chunks = 0;
    let finish = null;
    let usage = null;
    let drawn = false;
    const draw = () => {
      if (drawn) return;
      drawn = true;
      requestAnimationFrame(() => { drawn = false; body.innerHTML = markdown.render(answer); div.scrollIntoView({ block: "end" }); });
    };
    div.dataset.state = "waiting";
    div.dataset.chunks = "0";
    controller = new AbortController();
    busy(true);
    const t0 = performance.now();
    let tFirst = null;
    try {
      const r = await colibri.call("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(requestBody()), signal: controller.signal,
      });
      if (!r.ok) throw new Error(await colibri.errorText(r));
      div.dataset.state = "streaming";
      for await (const data of events(r)) {
        if (data === "[DONE]") break;
        const obj = JSON.parse(data);
        const err = colibri.errorOf(obj);
        if (err) throw new Error(err);
        const ch = obj.choices && obj.choices[0];
        if (ch && ch.delta && ch.delta.content) {
          if (tFirst === null) tFirst = performance.now();
          answer += ch.delta.content;
          chunks++;
          div.dataset.chunks = String(chunks);
          draw();
        }
        if (ch && ch.finish_reason) finish = ch.finish_reason;
        if (obj.usage) usage = obj.usage;
      }
      div.dataset.state = "done";
      div.dataset.finish = finish || "";
      history.push({ role: "assistant", content: answer });
      const secs = (performance.now() - (tFirst || t0)) / 1000;
      const n = usage ? usage.completion_tokens : chunks;
      meta.textContent = n + " tokens" + (secs > 0 && n > 1 ? ", " + ((n - 1) / secs).toFixed(1) + " tokens/s" : "") +
        (finish ? " · " + finish : "") + (usage ? " · prompt " + usage.prompt_tokens + " tokens" : "");
    } catch (e) {
      if (e.name === "AbortError") {
        div.dataset.state = "stopped";
        meta.textContent = "stopped after " + chunks + " pieces";
        if (answer) history.push({ role: "assistant", content: answer }); else history.pop();
      } else {
        div.dataset.state = "error";
        history.pop();              // the failed turn is not sent again
        const p = colibri.el("div", "error", e.message);
        div.appendChild(p);
      }
    } finally {
      body.innerHTML = markdown.render(answer);
      controller = null;
      busy(false);
      $("prompt").focus();
    }
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stopbtn").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    $("messages").textContent = "";
  });
  loadModel();
})();

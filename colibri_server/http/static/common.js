"use strict";
// Shared by the chat and status pages: calls to this gateway with the API key when it asks for one
// (kept in this page's memory only: a reload asks again), the API's error text, small DOM helpers.
const colibri = (() => {
  let key = null;
  let asking = null;

  function askKey(message) {
    if (asking) return asking;
    const dlg = document.getElementById("keydlg");
    const form = document.getElementById("keyform");
    const input = document.getElementById("keyinput");
    document.getElementById("keymsg").textContent = message;
    dlg.hidden = false;
    input.value = "";
    input.focus();
    asking = new Promise((resolve) => {
      form.onsubmit = (ev) => {
        ev.preventDefault();
        key = input.value.trim() || null;
        dlg.hidden = true;
        asking = null;
        resolve();
      };
    });
    return asking;
  }

  // fetch(path) on this gateway; a 401 asks the user for the key and tries again with it
  async function call(path, opts = {}) {
    for (;;) {
      const headers = Object.assign({}, opts.headers || {});
      if (key) headers["Authorization"] = "Bearer " + key;
      const r = await fetch(path, Object.assign({}, opts, { headers, cache: "no-store" }));
      if (r.status !== 401) return r;
      await askKey(await errorText(r));
    }
  }

  // an error as the API words it: {"error": {"message", "code"}} (OpenAI's shape), else the body
  function errorOf(obj) {
    const e = obj && obj.error;
    if (!e) return null;
    if (typeof e === "string") return e;
    return (e.message || JSON.stringify(e)) + (e.code ? " (" + e.code + ")" : "");
  }

  async function errorText(r) {
    const text = await r.text();
    try {
      const msg = errorOf(JSON.parse(text));
      if (msg) return msg;
    } catch (_) { /* not JSON */ }
    return "HTTP " + r.status + (text ? ": " + text.slice(0, 300) : "");
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function bytes(n) {
    if (typeof n !== "number") return "-";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + u[i];
  }

  return { call, errorOf, errorText, el, bytes };
})();

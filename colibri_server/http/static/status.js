"use strict";
// The status page: /status.json (the router's stats, as `colibri status --json`) polled every second
// while the page is visible; workers, batch, KV, memory, and the heat map of expert routing.
(() => {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  let last = null;

  function card(label, value, id) {
    const c = colibri.el("div", "card");
    c.appendChild(colibri.el("div", "label", label));
    const v = colibri.el("div", "value", value);
    if (id) v.id = id;
    c.appendChild(v);
    return c;
  }

  function uptime(s) {
    if (typeof s !== "number") return "-";
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return (h ? h + " h " : "") + (h || m ? m + " min " : "") + Math.floor(s % 60) + " s";
  }

  function summary(st) {
    const r = st.recent || {};
    const ready = (st.workers || []).filter((w) => w.state === "ready").length;
    const s = $("summary");
    s.textContent = "";
    const name = String(st.model || "").split("/").pop();
    s.appendChild(card("model", name + (st.context ? " · " + st.context + " ctx" : "")));
    s.appendChild(card("generation", st.starting ? st.generation + " (starting)" : st.generation));
    s.appendChild(card("workers ready", ready + " of " + (st.workers || []).length, "workers-ready"));
    s.appendChild(card("queued", st.queue, "queue"));
    s.appendChild(card("in flight", st.in_flight, "in-flight"));
    s.appendChild(card("tokens/s (last " + Math.round(r.window_s || 0) + " s)", r.tokens_per_s ?? "-", "tokens-per-s"));
    s.appendChild(card("rows per step (recent)", r.rows_per_step ?? "-"));
    s.appendChild(card("router uptime", uptime(st.uptime_s)));
    if (st.draining) s.appendChild(card("draining", "yes"));
  }

  function workers(st) {
    const tb = $("workers").querySelector("tbody");
    tb.textContent = "";
    for (const w of st.workers || []) {
      const e = w.engine || {};
      const mem = (k) => (w.remote ? "(remote)" : w.memory_sampled === false ? "…" : colibri.bytes(w[k]));
      const cells = [w.pid, w.wid, w.generation, w.state, (w.cores || []).join(",") || "-", w.running, w.served,
        (e.batch_rows_last ?? "-") + " / " + (e.batch_rows_mean ?? "-"),
        [e.kv_blocks_used, e.kv_blocks_free, e.kv_blocks_cached, e.kv_blocks].map((x) => x ?? "-").join(" / "),
        e.prefix_hits ?? "-", e.preemptions ?? "-", mem("uss"), mem("pss"), mem("rss")];
      const tr = colibri.el("tr", "worker");
      tr.dataset.pid = w.pid;
      tr.dataset.state = w.state;
      for (const c of cells) tr.appendChild(colibri.el("td", null, c));
      tb.appendChild(tr);
    }
  }

  function heatmap(st) {
    const recent = $("heatmode").value === "recent";
    const counts = (recent ? (st.recent || {}).expert_counts : st.expert_counts) || [];
    const box = $("heatmap");
    if (!counts.length) {
      box.textContent = "";
      box.dataset.layers = "0";
      $("heatnote").textContent = "no routing counts: a dense model, or no worker has reported yet";
      return;
    }
    const L = counts.length, E = counts[0].length;
    if (box.dataset.layers !== String(L) || box.dataset.experts !== String(E)) {
      box.textContent = "";
      box.dataset.layers = String(L);
      box.dataset.experts = String(E);
      box.style.gridTemplateColumns = "4em repeat(" + E + ", minmax(6px, 1fr)) 7em";
      box.appendChild(colibri.el("div", "hlabel", "layer"));
      for (let e = 0; e < E; e++) box.appendChild(colibri.el("div", "hlabel", E <= 64 || e % 8 === 0 ? e : ""));
      box.appendChild(colibri.el("div", "hlabel", "max / mean"));
      for (let l = 0; l < L; l++) {
        box.appendChild(colibri.el("div", "hlabel", l));
        for (let e = 0; e < E; e++) {
          const c = colibri.el("div", "cell");
          c.id = "cell-" + l + "-" + e;
          c.dataset.layer = l;
          c.dataset.expert = e;
          box.appendChild(c);
        }
        const sk = colibri.el("div", "skew");
        sk.id = "skew-" + l;
        box.appendChild(sk);
      }
    }
    let all = 0;
    for (let l = 0; l < L; l++) {
      const row = counts[l];
      let max = 0, sum = 0;
      for (const v of row) { max = Math.max(max, v); sum += v; }
      all += sum;
      for (let e = 0; e < E; e++) {
        const v = row[e], c = $("cell-" + l + "-" + e);
        c.dataset.count = v;
        c.title = "layer " + l + ", expert " + e + ": " + v + (sum ? " (" + (100 * v / sum).toFixed(1) + "% of the layer)" : "");
        c.style.backgroundColor = v ? "rgba(200, 60, 20, " + (0.08 + 0.92 * v / max).toFixed(3) + ")" : "";
      }
      $("skew-" + l).textContent = sum ? (max / (sum / E)).toFixed(2) + "×" : "-";
    }
    $("heatnote").textContent = (recent ? "choices in the last " + Math.round((st.recent || {}).window_s || 0) + " s"
      : "choices since the generation started") + ": " + all + " in all. Each row is one layer's " + E +
      " experts, darker where its router chose one more often (scaled to the row's busiest); max / mean: how " +
      "skewed the layer is (1.00× is even).";
  }

  function counters(st) {
    const c = st.counters || {};
    const keys = Object.keys(c).sort();
    $("counters").textContent = keys.length ? keys.map((k) => k + " " + c[k]).join(" · ") : "none yet";
  }

  function render(st) {
    last = st;
    summary(st);
    workers(st);
    heatmap(st);
    counters(st);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  async function poll() {
    if (!document.hidden) {
      try {
        const r = await colibri.call("/status.json");
        if (!r.ok) throw new Error(await colibri.errorText(r));
        render(await r.json());
        $("problem").hidden = true;
      } catch (e) {
        $("problem").textContent = "cannot read the server's status: " + e.message;
        $("problem").hidden = false;
      }
    }
    setTimeout(poll, POLL_MS);
  }

  $("heatmode").addEventListener("change", () => { if (last) heatmap(last); });
  poll();
})();

"use strict";
// A small markdown renderer for the model's answers: fenced code, inline code, headings, lists,
// quotes, bold, italics, links (http and https only), paragraphs and line breaks. Everything is
// escaped first; only the tags written here reach the page. An unclosed fence (a code block still
// streaming) renders as code.
const markdown = (() => {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

  function inline(text) {
    // code spans first: their content is taken literally
    return text.split(/(`+[^`]*`+)/).map((part) => {
      const m = /^(`+)([^`]*)\1$/.exec(part);
      if (m) return "<code>" + esc(m[2]) + "</code>";
      let s = esc(part);
      s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
        (_, t, u) => '<a href="' + u + '" rel="noopener noreferrer" target="_blank">' + t + "</a>");
      s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
      s = s.replace(/__([^_]+)__/g, "<strong>$1</strong>");
      s = s.replace(/(^|[^*\w])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
      s = s.replace(/(^|[^_\w])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
      return s;
    }).join("");
  }

  function render(src) {
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null;        // {tag, items}
    const flushPara = () => {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
    };
    const flushList = () => {
      if (list) out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") +
                         "</" + list.tag + ">");
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^\s*(```+|~~~+)\s*([\w+#.-]*)/.exec(line);
      if (fence) {
        flushPara(); flushList();
        const code = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) code.push(lines[i]);
        const cls = fence[2] ? ' class="lang-' + esc(fence[2]) + '"' : "";
        out.push("<pre><code" + cls + ">" + esc(code.join("\n")) + "</code></pre>");
        continue;
      }
      const h = /^(#{1,6})\s+(.*)$/.exec(line);
      const li = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      const q = /^>\s?(.*)$/.exec(line);
      if (h) {
        flushPara(); flushList();
        out.push("<h" + h[1].length + ">" + inline(h[2]) + "</h" + h[1].length + ">");
      } else if (li) {
        flushPara();
        const tag = /\d/.test(li[1]) ? "ol" : "ul";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push(li[2]);
      } else if (q) {
        flushPara(); flushList();
        out.push("<blockquote>" + inline(q[1]) + "</blockquote>");
      } else if (!line.trim()) {
        flushPara(); flushList();
      } else if (list && /^\s+\S/.test(line)) {
        list.items[list.items.length - 1] += " " + line.trim();
      } else {
        flushList();
        para.push(line);
      }
    }
    flushPara(); flushList();
    return out.join("");
  }

  return { render, esc };
})();

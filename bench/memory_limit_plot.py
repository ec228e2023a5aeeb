"""The README's memory-limit figure: tok/s against a memory cgroup's limit (% of the model file), colibri
against llama.cpp, one panel per recorded curve:

- batch-1 decode on bench-mixtral f16, whose router concentrates (bench/memory_limit.py's JSON: colibri
  with its weights budget, colibri left to the kernel's LRU, llama-bench);
- the same on the balanced model (bench/balanced_mixtral.py: uniform routing, residency's worst case);
- 8-client serving on bench-mixtral f16 (bench/memory_limit_serve.py's JSON: colibri serve, llama-server).

    python bench/memory_limit_plot.py --decode bench/recorded/memory-limit-chosen-2026-12-06-xeon-amx.json \\
        --balanced bench/recorded/memory-limit-balanced-chosen-2026-12-06-xeon-amx.json \\
        --serve bench/recorded/memory-limit-serve-chosen-2026-12-06-xeon-amx.json --svg docs/memory-limit.svg

A panel's dashed line is colibri's own speed with no limit (the file cached). Log scale.
"""
from __future__ import annotations

import argparse
import json
import math

BLUE, GREY, RED = "#1f77b4", "#7f7f7f", "#d62728"
DECODE = (("colibri", "decode_tok_s", "colibri, weights_memory", BLUE),
          ("colibri_lru", "decode_tok_s", "colibri, kernel LRU", GREY),
          ("llama", "decode_tok_s", "llama-bench (mmap)", RED))
SERVE = (("colibri", "tok_s", "colibri serve", BLUE), ("llama-server", "tok_s", "llama-server (mmap)", RED))
PW, PH, L, B, T, R = 300, 300, 46, 40, 44, 22     # one panel: width, height, margins
LEG = 50                                           # the legend's rows, under the panel


def _val(row, key, field):
    v = (row.get(key) or {}).get(field) if isinstance(row.get(key), dict) else None
    return v if isinstance(v, (int, float)) and v > 0 else None


def panel(out: dict, series, title: str, sub: str, x0: float) -> list:
    """One panel's SVG elements at x offset x0: a line per series (x: limit %, y: log tok/s)."""
    rows = sorted(out["rows"], key=lambda r: r["limit_pct"])
    ref = (out.get("reference", {}).get("colibri") or {}).get(series[0][1])
    vals = [v for r in rows for k, f, _, _ in series if (v := _val(r, k, f))] + ([ref] if ref else [])
    lo, hi = math.log10(max(0.1, min(vals) / 1.5)), math.log10(max(vals) * 1.5)
    xs = [r["limit_pct"] for r in rows]
    left, right = x0 + L, x0 + PW - R

    def X(p):
        return left + (p - 25) / 75 * (right - left)

    def Y(v):
        return T + (hi - math.log10(v)) / (hi - lo) * (PH - T - B)
    g = [f'<text x="{left}" y="16" font-size="12">{title}</text>',
         f'<text x="{left}" y="30" fill="#555">{sub}</text>',
         f'<line x1="{left}" y1="{PH - B}" x2="{right}" y2="{PH - B}" stroke="black"/>',
         f'<line x1="{left}" y1="{T}" x2="{left}" y2="{PH - B}" stroke="black"/>',
         f'<text x="{left + 40}" y="{PH - 8}">limit, % of the model file</text>']
    for p in sorted(set(xs) | {25, 50, 75, 100}):
        g.append(f'<text x="{X(p) - 10:.0f}" y="{PH - B + 14}">{p:.0f}%</text>')
    for d in range(math.floor(lo), math.ceil(hi) + 1):
        for m in (1, 2, 5):
            v = m * 10 ** d
            if lo <= math.log10(v) <= hi:
                g.append(f'<line x1="{left - 3}" y1="{Y(v):.1f}" x2="{right}" y2="{Y(v):.1f}" stroke="#eee"/>'
                         f'<text x="{left - 28}" y="{Y(v) + 4:.1f}">{v:g}</text>')
    for i, (k, f, name, color) in enumerate(series):
        pts = [(X(r["limit_pct"]), Y(v)) for r in rows if (v := _val(r, k, f))]
        if pts:
            g.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
            g += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in pts]
        g.append(f'<line x1="{left}" y1="{PH + 6 + 14 * i}" x2="{left + 16}" y2="{PH + 6 + 14 * i}" '
                 f'stroke="{color}" stroke-width="2"/><text x="{left + 20}" y="{PH + 10 + 14 * i}" '
                 f'font-size="10">{name}</text>')
    if ref:
        g.append(f'<line x1="{left}" y1="{Y(ref):.1f}" x2="{right}" y2="{Y(ref):.1f}" stroke="{BLUE}" '
                 f'stroke-dasharray="4 3"/><text x="{left + 4}" y="{Y(ref) - 4:.1f}" font-size="10">'
                 f'colibri, no limit: {ref:.0f}</text>')
    return g


def draw(panels, path: str) -> None:
    W = PW * len(panels)
    g = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{PH + LEG}" font-family="sans-serif" '
         f'font-size="11">', f'<rect width="{W}" height="{PH + LEG}" fill="white"/>',
         f'<text x="6" y="{T + 90}" transform="rotate(-90 14 {T + 90})">tok/s</text>']
    for i, (out, series, title, sub) in enumerate(panels):
        g += panel(out, series, title, sub, i * PW)
    g.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(g) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", help="bench/memory_limit.py's JSON, the concentrating model")
    ap.add_argument("--balanced", help="bench/memory_limit.py's JSON, the balanced model")
    ap.add_argument("--serve", help="bench/memory_limit_serve.py's JSON")
    ap.add_argument("--svg", required=True)
    a = ap.parse_args(argv)
    panels = []
    for path, series, title, sub in ((a.decode, DECODE, "batch-1 decode", "bench-mixtral f16, 1 thread"),
                                     (a.balanced, DECODE, "batch-1 decode, balanced router",
                                      "bench-mixtral-balanced f16, 1 thread"),
                                     (a.serve, SERVE, "8-client serving", "bench-mixtral f16, 2 threads")):
        if path:
            with open(path) as f:
                panels.append((json.load(f), series, title, sub))
    draw(panels, a.svg)


if __name__ == "__main__":
    main()

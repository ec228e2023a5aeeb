"""The text of `colibri status` (and the demo's report): a running server's stats as a table of its
workers with their cores, load and memory, the batch engines' figures and the last reload."""
from __future__ import annotations

from ..host.memory import mib

__all__ = ["format_status"]


def format_status(st) -> str:
    out = [f"model      {st['model']} ({mib(st['model_bytes'])}), generation {st['generation']}",
           f"queue      {st['queue']} queued, {st['in_flight']} in flight{'  (draining)' if st['draining'] else ''}",
           f"router     pid {st['router']['pid']}, RSS {mib(st['router']['rss'])}",
           f"{'pid':>8} {'id':>4} {'gen':>4} {'state':13} {'cores':10} {'run':>4} {'served':>7} "
           f"{'RSS':>11} {'USS':>11} {'PSS':>11} {'anon':>11}"]
    local = [w for w in st["workers"] if not w.get("remote")]
    remote = [w for w in st["workers"] if w.get("remote")]
    sampled = [w for w in local if w.get("memory_sampled", True)]

    def fig(w, k):      # a figure the router has not sampled yet is unknown, not 0
        return mib(w[k]) if w.get("memory_sampled", True) else "-"
    for w in local:
        out.append(f"{w['pid']:>8} {w['wid']:>4} {w['generation']:>4} {w['state']:13} {str(w['cores']):10} "
                   f"{w['running']:>4} {w['served']:>7} {mib(w['rss']):>11} {fig(w, 'uss'):>11} {fig(w, 'pss'):>11} "
                   f"{fig(w, 'anon_private'):>11}")
    for w in remote:        # another machine's processes: no memory figures here
        out.append(f"{w['pid']:>8} {w['wid']:>4} {w['generation']:>4} {w['state']:13} {str(w['cores']):10} "
                   f"{w['running']:>4} {w['served']:>7}  on worker host {w.get('host')} (model {w.get('identity')})")
    for w in st["workers"]:
        e = w.get("engine") or {}
        if e:
            out.append(f"{w['pid']:>8} batch: {e.get('running', 0)} running, {e.get('waiting', 0)} waiting, "
                       f"{e.get('batch_rows_last', 0)} rows last step ({e.get('batch_rows_mean', 0)} mean over "
                       f"{e.get('steps', 0)}); KV {e.get('kv_blocks_used', 0)}/{e.get('kv_blocks', 0)} blocks used "
                       f"({e.get('kv_blocks_cached', 0)} cached, {e.get('kv_dtype', '?')}), "
                       f"{e.get('preemptions', 0)} preemptions, {e.get('prefix_hits', 0)} prefix hits")
    wf = next((w["engine"]["weights"] for w in st["workers"] if isinstance((w.get("engine") or {}).get("weights"), dict)),
              None)
    if wf:
        uses = max(1, wf.get("routes", 0))
        held = wf.get("ceiling", wf["weights_memory"])
        short = f" (held to {mib(held)}: memory is short)" if held < wf["weights_memory"] else ""
        out.append(f"weights    budget {mib(wf['weights_memory'])}{short}: {mib(wf['locked_bytes'])} locked, "
                   f"{wf['experts_resident']}/{wf['experts']} experts; of {wf.get('routes', 0)} expert uses "
                   f"{100 * wf.get('resident', 0) / uses:.0f}% locked, {100 * wf.get('predicted', 0) / uses:.0f}% read "
                   f"ahead, {wf.get('missed', 0)} stalls ({mib(wf.get('missing_bytes', 0))} read while waiting); "
                   f"prediction {100 * wf.get('prediction_hits', 0) / max(1, wf.get('predictions', 0)):.0f}% right")
    if len(sampled) < len(local):
        out.append(f"memory     not sampled yet for {len(local) - len(sampled)} of {len(local)} workers "
                   "(the router samples off its loop; ask again)")
    if "master" in st and sampled and len(sampled) == len(local):
        resident = st["master"]["model_pss"] + sum(w.get("model_pss", 0) for w in local)
        out.append(f"weights    one copy: the {mib(st['model_bytes'])} model file's pages, shared by the master and "
                   f"{len(local)} workers, add up to {mib(resident)} resident (PSS of the mapping)")
    if sampled:
        out.append(f"per worker own memory (USS) {', '.join(fig(w, 'uss') for w in local)}; "
                   f"private anonymous {', '.join(fig(w, 'anon_private') for w in local)}")
    if st.get("memory_age_s") is not None:
        out.append(f"memory     figures sampled {st['memory_age_s']:.1f}s ago (off the router's loop)")
    r = st.get("recent") or {}
    if r.get("window_s"):
        out.append(f"recent     last {r['window_s']:.0f}s: {r.get('tokens', 0)} tokens ({r.get('tokens_per_s', 0)}/s), "
                   f"{r.get('steps', 0)} steps of {r.get('rows_per_step', 0)} rows")
    if st.get("counters"):
        out.append("counters   " + ", ".join(f"{k}={v}" for k, v in sorted(st["counters"].items())))
    lr = st.get("last_reload")
    if lr:
        out.append(f"reload     generation {lr.get('generation')} " +
                   ("committed" if lr.get("ok") else f"ROLLED BACK: {lr.get('error')}"))
    return "\n".join(out)

"""Logit error against llama.cpp on a shared prefix (issue 32): SmolLM2-135M-Instruct's Q4_1 GGUF, teacher-forced.

    python bench/agree_logits.py collect --out REF.json [--data ~/.cache/colibri-real] [--llama-bin bench/.anchors/bin]
    python bench/agree_logits.py compare REF.json [--colibri FILE] [--no-exact-head] [--json OUT]

collect: for each of bench/real_model.py's ~87 prompts, llama-server's default run (flash attention auto, f16 KV)
gives its 32 greedy tokens and, at each of those positions, its top-K log-probabilities (`n_probs`); llama-server
with `-fa off` is then fed the same prefixes (prompt + the default run's first j tokens, one token a call with
`cache_prompt`) and gives its top-K there too, and its own greedy run for the 16-of-32 count.
compare: colibri's log-softmax on the same prefixes (one prefill of prompt + the default run's tokens; prefill and
decode are the same bits) against the default run, beside llama's `-fa off` against its default.

Per position the error is the RMS, over the default run's top-K tokens, of the log-probability difference with
its mean removed (a logit error up to the shift that the normalisation absorbs); printed as its mean and median
over all positions, with the share of positions whose greedy token (argmax) differs from the default run's and
the count of prompts with >= 16 of 32 free-running greedy tokens in common.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from real_model import LlamaServer, common_prefix, convert, fetch_gguf, more_prompts  # noqa: E402

N, K = 32, 20


def _top(p):
    return [[t["id"], t["logprob"]] for t in p["top_logprobs"]]


def collect(a) -> None:
    gguf = a.gguf or fetch_gguf(a.data)
    prompts = more_prompts()
    rows = []
    s = LlamaServer(a.llama_bin, gguf)
    try:
        for pr in prompts:
            ids = s.tokenize(pr)
            r = s.post("/completion", {"prompt": ids, "n_predict": N, "temperature": 0, "top_k": 1, "n_probs": K,
                                       "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
            rows.append({"prompt": pr, "ids": ids, "tokens": r["tokens"],
                         "top_on": [_top(p) for p in r["completion_probabilities"]]})
    finally:
        s.close()
    if not a.fa_off:
        a.out.write_text(json.dumps({"n": N, "k": K, "rows": rows}))
        return
    s = LlamaServer(a.llama_bin, gguf, extra=("-fa", "off"))
    try:
        for row in rows:
            top = []
            for j in range(N):
                r = s.post("/completion", {"prompt": row["ids"] + row["tokens"][:j], "n_predict": 1, "temperature": 0,
                                           "top_k": 1, "n_probs": K, "ignore_eos": True, "return_tokens": True,
                                           "cache_prompt": True})
                top.append(_top(r["completion_probabilities"][0]))
            row["top_off"] = top
            row["greedy_off"] = s.greedy(row["ids"], N)
    finally:
        s.close()
    a.out.write_text(json.dumps({"n": N, "k": K, "rows": rows}))


def errors(ref_top, lp_of) -> float:
    """The centred RMS log-prob error over the reference's top-K tokens at one position; lp_of(ids) gives the
    other side's log-probs of those ids (NaN where it does not know them)."""
    ids = [t for t, _ in ref_top]
    ref = np.array([v for _, v in ref_top])
    oth = np.asarray(lp_of(ids), np.float64)
    ok = ~np.isnan(oth)
    d = oth[ok] - ref[ok]
    return float(np.sqrt(np.mean((d - d.mean()) ** 2)))


def margin(top) -> float:
    """The reference's top-1 minus top-2 log-probability at one position."""
    return top[0][1] - top[1][1]


def summary(name, ref, errs, flips, common, margins) -> dict:
    """The figures of one side against the default run; margins: per prompt that parts from it, (the default
    run's top-2 margin, this side's) at the first differing token."""
    e = np.array(errs)
    flip_margins = [margin(row["top_on"][j]) for i, row in enumerate(ref["rows"]) for j in range(ref["n"])
                    if flips[i * ref["n"] + j]]
    out = {"mean_err": float(e.mean()), "median_err": float(np.median(e)), "p90_err": float(np.percentile(e, 90)),
           "argmax_differs": int(sum(flips)), "positions": len(flips),
           "median_ref_margin_where_argmax_differs": float(np.median(flip_margins)) if flip_margins else None,
           "agree_16": int(sum(c >= 16 for c in common)), "mean_common": float(np.mean(common)),
           "prompts": len(common), "common": [int(c) for c in common],
           "margins_at_first_difference": [[round(x, 4) for x in m] for m in margins],
           "median_ref_margin_at_first_difference": float(np.median([m[0] for m in margins])) if margins else None}
    print(f"{name}: logit error mean {out['mean_err']:.4f} median {out['median_err']:.4f} p90 {out['p90_err']:.4f}; "
          f"argmax differs at {out['argmax_differs']}/{out['positions']} teacher-forced positions (the default's "
          f"top-2 margin there: median {out['median_ref_margin_where_argmax_differs']:.3f}); free-running "
          f">= 16 of 32 in common {out['agree_16']}/{out['prompts']} (mean {out['mean_common']:.1f}; at the first "
          f"difference the default's top-2 margin median {out['median_ref_margin_at_first_difference']:.3f})",
          flush=True)
    return out


def paired(a, b) -> dict:
    """Prompts where only one of two sides keeps >= 16 tokens in common (the count difference's own spread)."""
    only_a = sum(x >= 16 > y for x, y in zip(a, b))
    only_b = sum(y >= 16 > x for x, y in zip(a, b))
    return {"only_first": only_a, "only_second": only_b}


def llama_off(ref) -> dict:
    errs, flips, common, margins = [], [], [], []
    for row in ref["rows"]:
        for j in range(ref["n"]):
            off = dict(map(tuple, row["top_off"][j]))
            errs.append(errors(row["top_on"][j], lambda ids: [off.get(t, np.nan) for t in ids]))
            flips.append(row["top_off"][j][0][0] != row["tokens"][j])
        c = common_prefix(row["tokens"], row["greedy_off"])
        common.append(c)
        if c < ref["n"]:
            margins.append((margin(row["top_on"][c]), margin(row["top_off"][c])))
    return summary("llama -fa off vs default", ref, errs, flips, common, margins)


def colibri_logprobs(m, row, n) -> np.ndarray:
    seq = row["ids"] + row["tokens"][:n - 1]
    lg = m.logits(seq)[len(row["ids"]) - 1:].astype(np.float64)
    lg -= lg.max(axis=1, keepdims=True)
    return lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))


def colibri(m, ref, name="colibri vs llama default") -> dict:
    errs, flips, common, margins = [], [], [], []
    for row in ref["rows"]:
        lp = colibri_logprobs(m, row, ref["n"])
        for j in range(ref["n"]):
            errs.append(errors(row["top_on"][j], lambda ids: lp[j, ids]))
            flips.append(int(np.argmax(lp[j])) != row["tokens"][j])
        ours = [int(t) for t in m.generate(row["ids"], max_tokens=ref["n"], ignore_eos=True)]
        c = common_prefix(row["tokens"], ours)
        common.append(c)
        if c < ref["n"]:
            two = np.sort(lp[c])[-2:]
            margins.append((margin(row["top_on"][c]), float(two[1] - two[0])))
    return summary(name, ref, errs, flips, common, margins)


def compare(a) -> None:
    from colibri_server.model import Model
    ref = json.loads(a.ref.read_text())
    res = {"llama -fa off": llama_off(ref)} if "top_off" in ref["rows"][0] else {}
    path = a.colibri or convert(fetch_gguf(a.data), a.data / "smollm2-auto.colibri", dtype="f16", quantize="auto")
    m = Model.open(str(path))
    m.set_exact_head(not a.no_exact_head)
    res["colibri"] = colibri(m, ref)
    if "llama -fa off" in res:
        res["paired_16"] = paired(res["colibri"]["common"], res["llama -fa off"]["common"])
        print(f"prompts with >= 16 in common for colibri only {res['paired_16']['only_first']}, for llama -fa off "
              f"only {res['paired_16']['only_second']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("collect", "compare"))
    ap.add_argument("ref", type=pathlib.Path, nargs="?")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path("~/.cache/colibri-real").expanduser())
    ap.add_argument("--llama-bin", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("LLAMA_BIN", ROOT / "bench" / ".anchors" / "bin")))
    ap.add_argument("--gguf", type=pathlib.Path, help="collect: this GGUF instead of the Q4_1 one")
    ap.add_argument("--no-fa-off", dest="fa_off", action="store_false", help="collect: the default run only")
    ap.add_argument("--colibri", type=pathlib.Path, help="compare: this .colibri file instead of the default import")
    ap.add_argument("--no-exact-head", action="store_true", help="the head on llama.cpp's int8 rounding")
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args()
    if a.what == "collect":
        collect(a)
    else:
        compare(a)


if __name__ == "__main__":
    main()

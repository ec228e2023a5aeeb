"""Perplexity of a GGUF as colibri serves it against llama-perplexity on the same file, in one run.

    python bench/perplexity.py GGUF [GGUF ...] [--llama-bin bench/.anchors/bin] [--json OUT]

Each GGUF is converted with colibri's defaults (`--quantize auto`: its block kinds kept as they are) and
scored on bench/real_model.py's held-back text (Python's bundled pydoc topics) with llama-perplexity's
protocol (chunks of 512 tokens, BOS first, the second half of each chunk scored), once with the default
output head (exact_head: its input rounded to int16) and once with llama.cpp's int8 rounding of it
(exact_head false); llama-perplexity runs on the GGUF itself (`--no-repack` where the build's repacking
dies). The two tokenizers are compared first: a perplexity of other tokens would mean nothing.

For bench-mixtral (random weights from bench/decode.py, a real 32000-token vocabulary) the figure is near
the vocabulary's size: it checks the arithmetic on the file, not the model's quality (SmolLM2's Q4_1 in
bench/real_model.py does that).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from real_model import N_CTX, LlamaServer, convert, held_back_text, llama_perplexity, perplexity  # noqa: E402


def llama_tokens(bin_dir, gguf, text) -> list:
    """llama.cpp's tokens of the text (llama-server's /tokenize, BOS first as llama-perplexity adds it)."""
    server = LlamaServer(bin_dir, gguf)
    try:
        return server.tokenize(text)
    finally:
        server.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="+", type=pathlib.Path)
    ap.add_argument("--llama-bin", type=pathlib.Path, default=HERE / ".anchors" / "bin")
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args()
    from colibri_server.model import Model
    res = {}
    with tempfile.TemporaryDirectory(prefix="colibri-ppl-") as tmp:
        text_path = pathlib.Path(tmp) / "held-back.txt"
        text = held_back_text()
        text_path.write_text(text)
        for gguf in a.gguf:
            path = convert(gguf, pathlib.Path(tmp) / (gguf.stem + ".colibri"))
            m = Model.open(str(path))
            ours = list(m.tokenizer.encode(text))
            same = ours == llama_tokens(a.llama_bin, gguf, text)         # each with its BOS first
            r = {"tokens": len(ours), "same_tokens": same, "chunks": len(ours) // N_CTX}
            print(f"{gguf.name}: {len(ours)} tokens, {r['chunks']} chunks of {N_CTX}; tokenizers agree: {same}",
                  flush=True)
            for name, exact in (("colibri", True), ("colibri, exact_head false", False)):
                m.set_exact_head(exact)
                r[name] = perplexity(m, text)
                print(f"  {name}: {r[name]:.4f}", flush=True)
            m.close()
            r["llama-perplexity"] = llama_perplexity(a.llama_bin, gguf, text_path)
            for name in ("colibri", "colibri, exact_head false"):
                r[name + " / llama"] = r[name] / r["llama-perplexity"]
            print(f"  llama-perplexity: {r['llama-perplexity']:.4f}; colibri / llama {r['colibri / llama']:.5f}x, "
                  f"exact_head false {r['colibri, exact_head false / llama']:.5f}x", flush=True)
            res[gguf.name] = r
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

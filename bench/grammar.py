"""What constrained decoding costs: decode with a JSON-schema grammar against the same decode without,
on bench-mixtral (vocab 32000), in process, with the server's defaults (BatchEngine, f16 KV, every core).

    python bench/grammar.py ~/.cache/colibri-speed/bench-mixtral-f16.colibri [--batch 1 8] [--rounds 3]

bench-mixtral carries no tokenizer (its weights are random and the benchmarks feed ids), and a mask is
only as cheap as the tokenizer's vocabulary allows: the script trains a 32000-token byte-level BPE on the
Python standard library's sources (cached beside the model) and gives it to the model. For each batch
size B: B requests of 32 prompt tokens, 48 decode steps timed, with and without the grammar (a schema
that cannot close within those steps), in alternating rounds; it prints the median ms per step of each,
their ratio, and the time spent in the grammar itself (mask, its application, advancing the matcher) as
a share of the constrained step. Target (issue 19): the mask costs < 10% of decode time.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sysconfig
import time

import numpy as np

from colibri_server.model import Model
from colibri_server.model import grammar as G
from colibri_server.model.serving import BatchEngine

SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "n": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}}},
    "required": ["name", "n", "tags"], "additionalProperties": False}}}, "required": ["rows"]}


def bench_tokenizer(vocab: int, cache_dir: str) -> str:
    path = os.path.join(cache_dir, f"bench-tokenizer-{vocab}.json")
    if not os.path.exists(path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        tk.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tk.save(path)
    with open(path) as f:
        return f.read()


class Timed:
    """Wraps Constraint's per-token calls (and the sampler's masking, by difference) to add up their time."""
    spent = 0.0

    @classmethod
    def install(cls):
        for name in ("allowed", "advance"):
            orig = getattr(G.Constraint, name)

            def wrapped(self, *a, _orig=orig):
                t0 = time.perf_counter()
                try:
                    return _orig(self, *a)
                finally:
                    cls.spent += time.perf_counter() - t0
            setattr(G.Constraint, name, wrapped)


def run(m, B, steps, grammar, rng_seed):
    rng = np.random.default_rng(rng_seed)
    V = m.config.vocab_size
    eng = BatchEngine(m, max_seqs=B, max_batch_tokens=256, kv_dtype="f16")
    for i in range(B):
        kw = {"grammar": ("json_schema", json.dumps(SCHEMA))} if grammar else {}
        eng.add(i, rng.integers(3, V, 32).tolist(), max_tokens=steps + 8, ignore_eos=True, **kw)
    while eng.sched.waiting or any(s.pending > 1 for s in eng.sched.running):
        eng.step()
    for _ in range(2):
        eng.step()
    Timed.spent = 0.0
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        n += len(eng.step())
    dt = time.perf_counter() - t0
    assert n == steps * B, f"{n} tokens in {steps} steps of {B}: a sequence ended early"
    return dt / steps, Timed.spent / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    m = Model.open(a.model, populate=True, context=1024)
    m.file.tokenizer_json = bench_tokenizer(m.config.vocab_size, os.path.dirname(os.path.abspath(a.model)))
    if a.threads > 1:
        m.set_threads(a.threads)
    t0 = time.perf_counter()
    G.tokenizer_for(m)
    print(f"llguidance tokenizer for {m.config.vocab_size} tokens: {time.perf_counter() - t0:.2f} s (once per worker)")
    Timed.install()
    for B in a.batch:
        free, con, share = [], [], []
        run(m, B, 4, True, 0)                          # warm: compile, first masks
        for r in range(a.rounds):
            free.append(run(m, B, a.steps, False, r)[0])
            step, g = run(m, B, a.steps, True, r)
            con.append(step)
            share.append(g / step)
        f, c = statistics.median(free), statistics.median(con)
        print(f"B={B:2d}: {f * 1e3:6.1f} ms/step free, {c * 1e3:6.1f} ms/step with the grammar: "
              f"{c / f:.3f}x; the grammar's own calls {statistics.median(share) * 100:.1f}% of the constrained step "
              f"({statistics.median(share) * c / B * 1e6:.0f} us per token)")


if __name__ == "__main__":
    main()

"""llama.cpp's block kinds kept as they are (`colibri convert --quantize blocks`) against colibri's q8 of the
same GGUF and llama.cpp's own llama-bench on the GGUF, in ONE run.

    python bench/blocks.py [--data DIR] [--ggufs Q4_K_M Q4_0 Q8_0] [--threads 1 2] [--reps 3] [--json OUT]
    python bench/blocks.py --rounds 5 --no-q8 ...     colibri and llama-bench in turns, each round's ratio

For each of bench-mixtral's GGUFs (llama-quantize from its F32 GGUF, as bench/decode.py builds them):
the .colibri file's size against the GGUF's, then batch-1 prefill (128 tokens) and decode (128 tokens)
tok/s of the blocks file, of the q8 file (`--quantize q8`) and of llama-bench on the GGUF (its defaults,
repacking on; where that dies, as its AMX matmul does on a 2-vCPU Xeon VM whose CPU runs AMX, the build
without AMX with repacking on (`NOAMX=1 bench/build_anchors.sh`), else repacking off: "repack" and "build" in
the JSON; llama_bench.run_best), at each thread count, one subprocess after the other (bench/decode.py's workers). Run it under
`flock /tmp/bench.lock`; on a shared machine compare the ratios of one run, not absolute figures. On a VM whose
speed moves by 20-30% from minute to minute (a 2-vCPU Zen 5: llama-bench's Q4_K_M decode 156-200 tok/s within an
hour), one turn of each proves little: `--rounds N` runs N turns of the blocks file and llama-bench (and the q8
file, unless `--no-q8`) at each thread count, prints each round's blocks / llama-bench ratio and their median,
and reports each system's median tok/s (the rounds themselves in the JSON).

The physical bound: the read bandwidth at each thread count is measured before and after each GGUF's runs
(bench/decode.py's Numba reads over a 1 GiB array and over the GGUF's own populated mapping; the limit is the
fastest read, the mean of before and after), and each decode figure is printed as a fraction of it:
"% bw" = decode tok/s x weight bytes read a token (the experts routed to, 2 of 8, plus every dense tensor
and one embedding row) / limit.

`--avx2` forces the AVX2 paths on an AVX-512 machine: colibri's workers compile for an AVX2-only CPU
(NUMBA_CPU_NAME=haswell, NUMBA_CPU_FEATURES = this host's without AVX-512/AMX/AVX-VNNI; kernels/cpu.py
follows them) and llama-bench is the AVX2 build (`AVX2=1 bench/build_anchors.sh`: LLAMA_BIN's sibling
bin-avx2, -DGGML_NATIVE=OFF with AVX2/FMA/F16C).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import decode as D
import llama_bench


def converted(data, name, how):
    from colibri_server.model.gguf_import import CONVERTER_VERSION, convert_gguf
    src = data / f"bench-mixtral-{name}.gguf"
    out = data / f"bench-mixtral-{name}-{how}.colibri"
    if not out.exists() or D.converter_of(out) != CONVERTER_VERSION:        # older converters: other kinds
        convert_gguf(str(src), str(out), "f16", quantize=how, progress=False, require_tokenizer=False)
    return src, out


def read_limit(path, threads):
    """The fastest of bench/decode.py's Numba reads (array and the file's mapping, 1 and 4 streams), GB/s."""
    r = D.run_worker("membw", path, threads, 5)
    return max(r.get(k, 0.0) for k in D.READS)


def one_round(src, blocks, q8, threads, reps):
    """One turn of each system at this thread count: the blocks file, the q8 file (unless None), llama-bench."""
    r = {"blocks": D.run_worker("colibri", blocks, threads, reps)}
    if q8 is not None:
        r["q8"] = D.run_worker("colibri", q8, threads, reps)
    try:
        r["llama"] = llama_bench.run_best(src, threads, reps, D.PROMPT_LEN, D.NEW_TOKENS)
    except RuntimeError as e:
        r["llama"] = {"error": str(e)[-500:]}
    return r


def median_round(rounds):
    """Each system's median tok/s over the rounds (its first round's other fields)."""
    out = {}
    for k in rounds[0]:
        out[k] = dict(rounds[0][k])
        for m in ("decode_tok_s", "prefill_tok_s"):
            v = [x[k].get(m) for x in rounds if x[k].get(m)]
            out[k][m] = statistics.median(v) if v else None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.environ.get("COLIBRI_BENCH_DATA", os.path.expanduser("~/.cache/colibri-speed")))
    ap.add_argument("--ggufs", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="turns of colibri and llama-bench at each thread count (the VM drifts: each round's ratio, "
                         "their median and each system's median tok/s)")
    ap.add_argument("--no-q8", action="store_true", help="leave colibri's q8 file of each GGUF out of the timed runs (its size is still reported)")
    ap.add_argument("--json")
    ap.add_argument("--avx2", action="store_true", help="both sides on their AVX2 paths (see above)")
    a = ap.parse_args()
    if a.avx2:
        from colibri_server.model.kernels.cpu import without_avx512
        os.environ.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=without_avx512())    # the workers inherit it
        llama_bench.LLAMA_BIN = llama_bench.LLAMA_BIN.parent / "bin-avx2"
    data = pathlib.Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    D.build_gguf(data, D.build_hf(data), a.ggufs)
    res = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "cpu": D._cpu(), "avx2_forced": a.avx2,
           "rows": []}
    for name in a.ggufs:
        src, blocks = converted(data, name, "blocks")
        _, q8 = converted(data, name, "q8")
        row = {"gguf": name, "gguf_bytes": src.stat().st_size, "blocks_bytes": blocks.stat().st_size,
               "q8_bytes": q8.stat().st_size}
        row["blocks_size_ratio"] = row["blocks_bytes"] / row["gguf_bytes"]
        row["q8_size_ratio"] = row["q8_bytes"] / row["gguf_bytes"]
        row["bytes_per_token"] = {"blocks": D.colibri_bytes_per_token(blocks), "q8": D.colibri_bytes_per_token(q8),
                                  "llama": D.gguf_bytes_per_token(src)}
        for th in a.threads:
            bw0 = read_limit(src, th)
            rounds = [one_round(src, blocks, None if a.no_q8 else q8, th, a.reps) for _ in range(a.rounds)]
            r = rounds[0] if a.rounds == 1 else median_round(rounds)
            row[f"t{th}"] = {k: {m: v.get(m) for m in ("decode_tok_s", "prefill_tok_s", "repack", "build", "error")}
                             for k, v in r.items()}
            if a.rounds > 1:
                row[f"t{th}"]["rounds"] = rounds
                for what in ("decode", "prefill"):
                    q = [x["blocks"].get(f"{what}_tok_s") / x["llama"][f"{what}_tok_s"] for x in rounds
                         if x["blocks"].get(f"{what}_tok_s") and x["llama"].get(f"{what}_tok_s")]
                    row[f"t{th}"][f"{what}_ratio_rounds"] = q
                    if q:
                        print(f"{name} {th} thread(s): {what} blocks / llama-bench per round "
                              + " ".join(f"{v:.2f}" for v in q) + f", median {statistics.median(q):.3f}x", flush=True)
            bw = (bw0 + read_limit(src, th)) / 2
            row[f"t{th}"]["read_GBps"] = bw
            dec = {k: v.get("decode_tok_s") for k, v in r.items()}
            for k, v in dec.items():
                if v:
                    row[f"t{th}"][k]["bw_fraction"] = v * row["bytes_per_token"][k] / (bw * 1e9)
            print(f"{name} {th} thread(s): read {bw:.1f} GB/s; decode at " + ", ".join(
                f"{k} {row[f't{th}'][k]['bw_fraction']:.0%}" for k in dec if dec[k]) + " of it", flush=True)
            pf = {k: v.get("prefill_tok_s") for k, v in r.items()}
            print(f"{name} {th} thread(s): decode tok/s blocks {dec['blocks']} / q8 {dec.get('q8')} / llama-bench "
                  f"{dec['llama']}; prefill blocks {pf['blocks']} / q8 {pf.get('q8')} / llama-bench {pf['llama']}",
                  flush=True)
        print(f"{name}: size blocks {row['blocks_size_ratio']:.4f}x the GGUF, q8 {row['q8_size_ratio']:.3f}x", flush=True)
        res["rows"].append(row)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

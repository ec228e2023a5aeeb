"""Long prompts: time to the first token and decode at depth, colibri against llama.cpp, in one run.

    python bench/long_prompt.py [--tokens 512 2048 8192 16384 32768] [--rev REV] [--new 33] [--json OUT]
                                [--shape mixtral|mixtral-gqa8|deepseek]

Model: bench-mixtral-long, bench-mixtral's shape (bench/decode.py BENCH_MIXTRAL: transformers,
torch.manual_seed(0)) with 32768 positions, built into --data once; --shape mixtral-gqa8: the same with 2 kv
heads (GQA 8:1), deepseek: families.py's bench-deepseek (latent attention). Converted to .colibri f16 (the
converter's defaults) and to GGUF F16 by llama.cpp's own convert_hf_to_gguf.py (tools/hf_to_gguf.py; the
source from $LLAMA_CPP_SRC, else bench/.anchors/llama.cpp; it needs the sentencepiece package).

For each prompt length P, one request alone on each server, one server after another:
  colibri        `colibri serve --model FILE --context C --max-prompt-tokens C` (its defaults otherwise:
                 workers, threads, step budget, prefix cache; every prompt is distinct random ids, so nothing
                 is reused)
  colibri@REV    --rev: the same command from a git worktree of an older revision, side by side
  llama-server   its defaults with -c C -np 1 (one sequence of the whole context), threads = the cores,
                 flash attention on and off (-fa on / off): the faster of the two for each figure
The request streams --new greedy tokens (EOS ignored): TTFT is the time from sending it to its first
token (the prefill of P tokens), decode the mean gap between the following tokens (decode at depth P).
--llama-limit S gives llama-server S seconds for a first token (default 3600); a prefill cut off there is
recorded as longer than S, and its ratio to colibri as a lower bound.
--llama-bench adds llama-bench's own decode at depth (-d P -p 0 -n 32, flash attention on and off).
Each server answers a short request first (warm-up, compiles) and is stopped after its lengths.
Prints TTFT and decode per system and length, the ratios (llama-server time / colibri time: > 1, colibri
is faster; and REV / this tree), and writes JSON (default bench/recorded/long-prompt-DATE-MACHINE.json).
The machine must be quiet: the systems take turns on its cores.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

import decode as D  # noqa: E402  (bench-mixtral's shape)
import families as F  # noqa: E402  (bench-deepseek's)

MAX_POSITIONS = 32768
ANCHORS = HERE / ".anchors"


def machine() -> str:
    try:
        model = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":")[1]
    except (OSError, StopIteration):
        return platform.node()
    for key, name in (("EPYC", "epyc"), ("Xeon", "xeon"), ("Ryzen", "ryzen")):
        if key in model:
            return name
    return model.split()[0].lower()


SHAPES = {            # name: (transformers model type, config), each with MAX_POSITIONS positions
    "mixtral": ("mixtral", dict(D.BENCH_MIXTRAL, max_position_embeddings=MAX_POSITIONS)),
    "mixtral-gqa8": ("mixtral", dict(D.BENCH_MIXTRAL, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS)),
    "deepseek": ("deepseek_v3", dict(F.MODELS["deepseek"][1], max_position_embeddings=MAX_POSITIONS)),
}


def build(data: pathlib.Path, shape: str = "mixtral"):
    """(.colibri f16, GGUF F16) of bench-SHAPE-long, built once: mixtral is bench-mixtral's shape (GQA 4:1),
    mixtral-gqa8 the same with 2 kv heads (8:1), deepseek families.py's bench-deepseek (latent attention)."""
    model_type, kw = SHAPES[shape]
    d = data / f"bench-{shape}-long"
    col, gg = data / f"bench-{shape}-long-f16.colibri", data / f"bench-{shape}-long-F16.gguf"
    if not (d / "config.json").exists():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import hf_models
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        print(f"building bench-{shape}-long with transformers (torch.manual_seed(0)) ...", flush=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float32).eval()
        model.save_pretrained(str(d), safe_serialization=True)
        hf_models.train_tokenizer(d, vocab_size=512)
        if model_type == "deepseek_v3":        # as the released V3's config.json says it (llama.cpp reads it)
            c = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**c, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}))
    if not col.exists():
        from colibri_server.model.convert import convert
        convert(str(d), str(col), "f16", progress=False)
    if not gg.exists():
        src = os.environ.get("LLAMA_CPP_SRC", str(ANCHORS / "llama.cpp"))
        subprocess.run([sys.executable, str(ROOT / "tools" / "hf_to_gguf.py"), str(d), "--outtype", "f16",
                        "--outfile", str(gg)], check=True, capture_output=True, env=dict(os.environ, LLAMA_CPP_SRC=src))
    return col, gg


def prompt(length: int, seed: int) -> list:
    return [int(t) for t in np.random.default_rng(seed).integers(3, D.VOCAB, length)]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_until(check, what, proc, timeout=900):
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001  (not up yet)
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout} s")


def figures(t0, stamps) -> dict:
    gaps = np.diff(stamps)
    return {"ttft_s": stamps[0] - t0, "decode_ms": 1e3 * float(np.mean(gaps)) if len(gaps) else None,
            "generated": len(stamps)}


class Colibri:
    """`colibri serve` of this tree, or of a revision's worktree (python -m colibri_server.cli from there)."""

    def __init__(self, a, path, tree=None):
        self.sock = os.path.join(a.tmp, f"colibri-{len(os.listdir(a.tmp))}.sock")
        argv = ([sys.executable, "-m", "colibri_server.cli"] if tree else [a.colibri_bin]) + [
            "serve", "--model", str(path), "--bind", f"ipc://{self.sock}", "--context", str(a.context),
            "--max-prompt-tokens", str(a.context), "--runtime-dir", self.sock + ".run"]
        env = dict(os.environ, PYTHONPATH=str(tree)) if tree else None
        self.log = open(self.sock + ".log", "w")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                  cwd=str(tree) if tree else None)
        from colibri_server.client import Client
        with Client(f"ipc://{self.sock}", timeout=2.0) as c:
            wait_until(lambda: c.health()["workers_ready"] >= 1, "colibri", self.p)
        self.c = Client(f"ipc://{self.sock}", timeout=3600)

    def run(self, ids, new):
        t0 = time.perf_counter()
        stamps = []
        with self.c.stream(ids, max_tokens=new, temperature=0.0, ignore_eos=True) as s:
            for chunk in s:
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        return figures(t0, stamps)

    def close(self):
        self.c.close()
        self.p.terminate()
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


class LlamaServer:
    def __init__(self, a, gguf, fa):
        self.port = free_port()
        self.limit = a.llama_limit
        self.log = open(os.path.join(a.tmp, f"llama-server-fa-{fa}.log"), "w")
        self.p = subprocess.Popen([str(a.llama_bin / "llama-server"), "-m", str(gguf), "-c", str(a.context), "-np", "1",
                                   "-t", str(a.threads), "-tb", str(a.threads), "-fa", fa, "--port", str(self.port),
                                   "--host", "127.0.0.1"], stdout=self.log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, LD_LIBRARY_PATH=str(a.llama_bin)))

        def health():
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        wait_until(health, "llama-server", self.p)

    def run(self, ids, new):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.limit)
        body = json.dumps({"prompt": ids, "n_predict": new, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                           "stream": True})
        t0 = time.perf_counter()
        c.request("POST", "/completion", body, {"Content-Type": "application/json"})
        try:
            r = c.getresponse()
        except TimeoutError:
            raise Overtime(self.limit) from None
        stamps = []
        for line in r:
            if not line.startswith(b"data: "):
                continue
            d = json.loads(line[6:])
            if d.get("stop"):
                break
            stamps.append(time.perf_counter())
        c.close()
        return figures(t0, stamps[:new])

    def close(self):
        self.p.terminate()
        self.p.wait(60)
        self.log.close()


def llama_bench_depth(a, gguf, depth) -> dict:
    """llama-bench -d depth -p 0 -n 32: decode tok/s at that depth, flash attention on and off."""
    out = {}
    for fa in ("on", "off"):
        r = subprocess.run([str(a.llama_bin / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "32", "-d", str(depth),
                            "-t", str(a.threads), "-r", "1", "-fa", fa, "-o", "json"],
                           capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(a.llama_bin)))
        if r.returncode:
            out[fa] = {"error": r.stderr[-500:]}
            continue
        row = json.loads(r.stdout)[0]
        out[fa] = {"decode_tok_s": row["avg_ts"]}
    return out


class Overtime(Exception):
    """No first token within --llama-limit seconds: the prefill took longer (a lower bound)."""

    def __init__(self, limit):
        super().__init__(f"no first token in {limit:g} s")
        self.limit = limit


def run_system(name, start, lengths, new, rows):
    print(f"{name}: starting", flush=True)
    srv = start()
    try:
        srv.run(prompt(16, 1), 4)                                                    # warm-up
        for i, P in enumerate(lengths):
            try:
                f = srv.run(prompt(P, 100 + i), new)
            except Exception as e:  # noqa: BLE001  (recorded; the other lengths go on)
                rows.append({"system": name, "tokens": P, "error": repr(e)[:300],
                             **({"ttft_over_s": e.limit} if isinstance(e, Overtime) else {})})
                print(f"  {name} {P:6d} tokens: {e!r}", flush=True)
                continue
            rows.append({"system": name, "tokens": P, **f})
            dm = f"{f['decode_ms']:.1f}" if f["decode_ms"] is not None else "-"
            print(f"  {name} {P:6d} tokens: TTFT {f['ttft_s']:.2f} s, decode {dm} ms/token", flush=True)
    finally:
        srv.close()


def report(rows, lengths, systems, rev):
    def get(system, P, k):
        r = [x[k] for x in rows if x["system"] == system and x["tokens"] == P and x.get(k) is not None]
        return min(r) if r else None
    table = []
    print("\n| prompt | " + " | ".join(f"{s} TTFT s" for s in systems) + " | llama-server / colibri | " +
          (f"{rev} / colibri | " if rev else "") + " | ".join(f"{s} decode ms" for s in systems) +
          " | decode llama / colibri |")
    print("|---" * (2 * len(systems) + 3 + bool(rev)) + "|")
    for P in lengths:
        t = {s: get(s, P, "ttft_s") for s in systems}
        d = {s: get(s, P, "decode_ms") for s in systems}

        def ratio(x, y):
            return round(x / y, 2) if x and y else None
        over = [x["ttft_over_s"] for x in rows if x["system"] == "llama-server" and x["tokens"] == P and "ttft_over_s" in x]
        if over and (t["llama-server"] is None or t["llama-server"] > min(over)):
            t["llama-server"] = min(over)       # --llama-limit cut the slower one off: a lower bound (">" below)
            print(f"({P} tokens: llama-server's TTFT is a lower bound, {min(over):g} s: --llama-limit)")
        row = {"tokens": P, "ttft_s": t, "decode_ms": d, "ttft_llama_over_colibri": ratio(t["llama-server"], t["colibri"]),
               "ttft_llama_lower_bound": bool(over and t["llama-server"] == min(over)),
               "decode_llama_over_colibri": ratio(d["llama-server"], d["colibri"])}
        if rev:
            row["ttft_rev_over_colibri"] = ratio(t[rev], t["colibri"])
            row["decode_rev_over_colibri"] = ratio(d[rev], d["colibri"])
        table.append(row)

        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"
        print(f"| {P} | " + " | ".join(fmt(t[s], ".2f") for s in systems) + f" | {fmt(row['ttft_llama_over_colibri'], '.2f')}x | "
              + (f"{fmt(row['ttft_rev_over_colibri'], '.2f')}x | " if rev else "")
              + " | ".join(fmt(d[s], ".1f") for s in systems) + f" | {fmt(row['decode_llama_over_colibri'], '.2f')}x |")
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=pathlib.Path,
                    default=os.environ.get("COLIBRI_BENCH_DATA", os.path.expanduser("~/.cache/colibri-speed")))
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--shape", default="mixtral", choices=list(SHAPES), help="the bench model (see build)")
    ap.add_argument("--new", type=int, default=33, help="tokens each request generates (decode at depth: the gaps)")
    ap.add_argument("--rev", help="also run this older colibri revision (a git worktree of it), side by side")
    ap.add_argument("--systems", nargs="+", default=["colibri", "rev", "llama-server"],
                    choices=["colibri", "rev", "llama-server"])
    ap.add_argument("--llama-limit", type=float, default=3600.0,
                    help="seconds llama-server gets for a first token; past them the prefill is recorded as longer than "
                         "that (a lower bound: its ratio to colibri is then at least limit / colibri's TTFT)")
    ap.add_argument("--llama-bench", action="store_true", help="also llama-bench's decode at each depth (-d)")
    ap.add_argument("--llama-bin", type=pathlib.Path, default=os.environ.get("LLAMA_BIN", str(ANCHORS / "bin")))
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t/-tb")
    ap.add_argument("--colibri-bin", default=shutil.which("colibri") or str(pathlib.Path(sys.executable).parent / "colibri"))
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args()
    if max(a.tokens) + a.new > MAX_POSITIONS:
        ap.error(f"--tokens: at most {MAX_POSITIONS - a.new} (the model's {MAX_POSITIONS} positions less --new)")
    if "llama-server" in a.systems and not (a.llama_bin / "llama-server").exists():
        ap.error(f"--llama-bin: no llama-server in {a.llama_bin} (bench/build_anchors.sh builds it)")
    a.context = max(a.tokens) + a.new + 16
    a.data.mkdir(parents=True, exist_ok=True)
    col, gg = build(a.data, a.shape)
    a.tmp = tempfile.mkdtemp(prefix="long-prompt-")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    what = "long-prompt" if a.shape == "mixtral" else f"long-prompt-{a.shape}"
    out = a.json or HERE / "recorded" / f"{what}-{time.strftime('%Y-%m-%d')}-{machine()}.json"
    rows, systems, tree, bench, rev, table = [], [], None, {}, None, []

    def save():                         # after every system: a run cut short keeps what it measured
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or machine(),
                                   "cpus": os.cpu_count(), "colibri": head, "rev": rev, "model": col.name,
                                   "gguf": gg.name, "new_tokens": a.new, "rows": rows, "table": table,
                                   "llama_bench_depth": bench}, indent=1))
    try:
        if a.rev and "rev" in a.systems:
            tree = pathlib.Path(a.tmp) / "rev"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), a.rev], check=True,
                           capture_output=True)
            rev = "colibri@" + subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True).stdout.strip()
            systems.append(rev)
            run_system(rev, lambda: Colibri(a, col, tree), a.tokens, a.new, rows)
            save()
        if "colibri" in a.systems:
            systems.insert(0, "colibri")
            run_system("colibri", lambda: Colibri(a, col), a.tokens, a.new, rows)
            save()
        if "llama-server" in a.systems:
            for fa in ("on", "off"):
                run_system(f"llama-server fa {fa}", lambda fa=fa: LlamaServer(a, gg, fa), a.tokens, a.new, rows)
                save()
            for r in [r for r in rows if r["system"].startswith("llama-server fa")]:
                rows.append({**r, "system": "llama-server", "from": r["system"]})
            systems.append("llama-server")
        if a.llama_bench:
            for P in a.tokens:
                bench[P] = llama_bench_depth(a, gg, P)
                print(f"  llama-bench -d {P}: {bench[P]}", flush=True)
                save()
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    if "colibri" in systems and "llama-server" in systems:
        table = report(rows, a.tokens, systems, rev)
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

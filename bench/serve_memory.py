"""What a served GGUF holds in memory: `colibri serve --http` on a GGUF converted with the defaults,
asked through the openai client, then each process's resident pages of the model file and its own.

    python bench/serve_memory.py [--gguf FILE] [--workers 1] [--requests 4]

Default GGUF: SmolLM2-135M-Instruct Q4_1 (bench/real_model.py fetches it). Prints, per process, the
model file's resident pages (model_rss: the weights it holds, shared between processes) and its
private memory (USS: its own pages: KV cache, workspace, interpreter, compiled code), the file's
and the GGUF's sizes, and resident weights / GGUF size (issue 32: within 5%). The weights are
resident once whatever the number of workers: each worker's model_rss counts the same pages.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=pathlib.Path, help="default: SmolLM2-135M-Instruct Q4_1, fetched once")
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path("~/.cache/colibri-real").expanduser())
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args()
    import openai

    from colibri_server.client import Client
    if a.gguf is None:
        import real_model
        a.gguf = real_model.fetch_gguf(a.data)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="colibri-servemem-"))
    model = tmp / (a.gguf.stem + ".colibri")
    colibri = [sys.executable, "-m", "colibri_server.cli"]
    subprocess.run(colibri + ["convert", str(a.gguf), str(model), "--quiet"], check=True)
    port, bind = free_port(), f"ipc://{tmp}/router.sock"
    srv = subprocess.Popen(colibri + ["serve", "--model", str(model), "--bind", bind, "--http", f"127.0.0.1:{port}",
                                      "--workers", str(a.workers), "--runtime-dir", str(tmp / "run")],
                           stdout=subprocess.DEVNULL, stderr=open(tmp / "serve.log", "w"), start_new_session=True)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 1800           # a cold compile on a loaded machine: wait on readiness
        while True:
            try:
                name = api.models.list().data[0].id
                break
            except Exception:
                if srv.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not come up: {(tmp / 'serve.log').read_text()[-2000:]}")
                time.sleep(0.5)
        answers = []
        for i in range(a.requests):
            r = api.chat.completions.create(model=name, max_tokens=64, temperature=0.0, messages=[
                {"role": "user", "content": ["What is the capital of France?", "Write a haiku about the sea.",
                                             "Name three prime numbers.", "Say hello in Spanish."][i % 4]}])
            answers.append(r.choices[0].message.content)
        time.sleep(1.0)
        with Client(bind, timeout=30) as c:
            st = c.stats()
            deadline = time.monotonic() + 30         # memory figures come from the router's sampler
            while st.get("memory_age_s") is None or st["memory_age_s"] > 1.0 or not st["workers"][0].get("model_rss"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
                st = c.stats()
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(60)
    gguf, file = a.gguf.stat().st_size, st["model_bytes"]
    rows = [("master", st["master"])] + [(f"worker {w['wid']}", w) for w in st["workers"]]
    print(f"GGUF {a.gguf.name}: {gguf / 2**20:.1f} MiB; .colibri {file / 2**20:.1f} MiB ({file / gguf:.4f}x)")
    print(f"first answer: {answers[0]!r}")
    for name, m in rows:
        print(f"{name}: model file resident {m.get('model_rss', 0) / 2**20:.1f} MiB"
              + (f", USS {m['uss'] / 2**20:.1f} MiB, RSS {m['rss'] / 2**20:.1f} MiB" if "uss" in m else ""))
    held = max(m.get("model_rss", 0) for _, m in rows)
    print(f"resident weights (the file's pages, shared) / GGUF: {held / gguf:.4f}x")
    if a.json:
        a.json.write_text(json.dumps({"gguf": str(a.gguf.name), "gguf_bytes": gguf, "colibri_bytes": file,
                                      "answers": answers, "workers": st["workers"], "master": st["master"],
                                      "resident_over_gguf": held / gguf}, indent=1, default=str))


if __name__ == "__main__":
    main()

"""`colibri` command line: serve | generate | status | config | run | chat | inspect | validate | convert.

Each subcommand is a small function over the model API; user errors (bad file, missing
model, bad arguments) print one line naming the thing at fault and exit 1 (2 for usage).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .bundled import BUNDLED_MODEL, model_file_problem

EXIT_ERROR = 1
EXIT_LOAD = 4        # serve/demo: the model, pidfile, runtime directory or keys cannot be used (master.EXIT_LOAD)


def _die(msg: str, code: int = EXIT_ERROR):
    print(f"colibri: error: {msg}", file=sys.stderr)
    sys.exit(code)


def default_model_path(path):
    """The --model given, or the model bundled with the package."""
    if path:
        return path
    if not os.path.exists(BUNDLED_MODEL):
        _die(f"no --model given and the bundled model is missing ({BUNDLED_MODEL}); "
             "reinstall the package or pass --model FILE.colibri")
    return BUNDLED_MODEL


def _open_model(path, **kw):
    from .model import Model
    from .model.format import ColibriFormatError
    path = default_model_path(path)
    problem = model_file_problem(path)
    if problem:
        _die(problem)
    try:
        return Model.open(path, **kw)
    except (ColibriFormatError, OSError) as e:
        _die(f"invalid model file {path}: {e}")


# ---------------------------------------------------------------------------- run

def cmd_run(a):
    m = _open_model(a.model, context=a.context, routing_noise=a.routing_noise, seed=a.seed,
                    prefill_bf16=a.prefill_bf16)
    m.set_exact_head(a.exact_head)
    params = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                  min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed,
                  stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos)
    if a.embedding:
        return _run_embedding(m, a)
    if a.prompt is None:
        _die("give a prompt (or --embedding FILE.npy)", 2)
    if a.chat and a.token_ids:
        _die("--chat takes the user's text, not --token-ids", 2)
    if a.system is not None and not a.chat:
        _die("--system goes with --chat", 2)
    from .commands.chat import ChatError, messages_for, model_info, prompt_ids
    try:
        prompt = (prompt_ids(m, model_info(m.path), messages_for(a.prompt, a.system)) if a.chat else
                  [int(t) for t in a.prompt.split(",")] if a.token_ids else a.prompt)
    except ChatError as e:
        _die(str(e))
    # compile (or load from the kernel cache) every kernel first: the figures below are the model's. When
    # something compiles (a first start of this kind of model), a second process compiles what `colibri serve`
    # will need, on another core, so that it starts warm
    others = []
    try:
        _generate(m, a, prompt, params, others)
        for p in others:
            if p.poll() is None:
                print("colibri: finishing the kernels `colibri serve` needs (once per machine)...", file=sys.stderr,
                      flush=True)
            p.wait()
    finally:
        for p in others:             # an error or Ctrl-C: no compile left running behind the command
            if p.poll() is None:
                p.terminate()
                p.wait()


def _generate(m, a, prompt, params, others):
    from .model.precompile import start_other_layouts
    compile_s = m.warm_up(announce=lambda msg: print(f"colibri: {msg}", file=sys.stderr, flush=True),
                          on_compile=lambda: others.append(start_other_layouts(m.path, "run")))
    t0 = time.perf_counter()
    n, first = 0, None
    try:
        for ev in m.stream(prompt, **params):
            if first is None:
                first = time.perf_counter()
            n += 1
            sys.stdout.write(ev.text if not a.token_ids else f"{ev.token_id} ")
            sys.stdout.flush()
    except ValueError as e:
        _die(str(e))
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    dec = (n - 1) / (t1 - first) if n > 1 and t1 > first else float("nan")
    print(f"[{n} tokens; first token after {first - t0:.3f}s (prefill); decode {dec:.1f} tok/s; "
          f"kernels ready in {compile_s:.2f}s before ({m.compiled} compiled), not counted]", file=sys.stderr)


def cmd_chat(a):
    from .commands.chat import ChatError, converse, model_info
    m = _open_model(a.model, context=a.context, seed=a.seed, prefill_bf16=a.prefill_bf16)
    m.set_exact_head(a.exact_head)
    try:
        info = model_info(m.path)
        m.warm_up(announce=lambda msg: print(f"colibri: {msg}", file=sys.stderr, flush=True))
        if sys.stdin.isatty():
            print("colibri chat: one message a line; /exit or Ctrl-D to end", file=sys.stderr)
        converse(m, info, dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                               min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed),
                 a.system)
    except ChatError as e:
        _die(str(e))
    except KeyboardInterrupt:
        sys.stdout.write("\n")


def _run_embedding(m, a):
    try:
        e = np.load(a.embedding, allow_pickle=False)
    except (OSError, ValueError) as err:
        _die(f"--embedding {a.embedding}: {err}")
    if e.ndim != 2 or e.shape[1] != m.config.hidden_size:
        _die(f"--embedding {a.embedding}: shape {e.shape}, expected (T, {m.config.hidden_size})")
    out = m.generate_from_embeddings(e, a.max_tokens, temperature=a.temperature, seed=a.seed)
    text = m.tokenizer.decode(out) if m.file.tokenizer_json else ""
    print(text if text else " ".join(map(str, out)))


# ---------------------------------------------------------------------------- inspect / validate

def cmd_inspect(a):
    from .model import format as fmt
    try:
        cf = fmt.ColibriFile.open(a.model)
    except (fmt.ColibriFormatError, FileNotFoundError) as e:
        _die(str(e))
    h = cf.header
    if a.gate is not None:
        from .commands.debug import format_gate
        try:
            print(format_gate(cf, a.gate, a.rows))
        except KeyError as e:
            _die(f"--gate {a.gate}: {e.args[0]}")
        return
    if a.tensor:
        if a.tensor not in cf:
            _die(f"no tensor named {a.tensor!r} in {a.model} (see `colibri inspect {a.model}`)")
        _print_rows(cf, a.tensor, a.rows)
        return
    if a.json:
        print(json.dumps({"header": h, "identity": cf.identity, "config": json.loads(cf.config_json or "{}"),
                          "metadata": json.loads(cf.metadata_json or "{}"),
                          "tensors": [r.__dict__ for r in cf.record_list]}, indent=1))
        return
    print(f"file      {cf.path}  ({h['file_size'] / 2**20:.1f} MiB)")
    print(f"identity  {cf.identity}  (a head admits worker hosts whose file has the same)")
    print("header    " + "  ".join(f"{k}={v}" for k, v in h.items()))
    print("config    " + cf.config_json)
    print("metadata  " + cf.metadata_json)
    print(f"tokenizer {len(cf.tokenizer_json)} bytes; chat template {len(cf.chat_template)} bytes")
    print(f"routing   {len(cf.routing)} layers: " + ", ".join(
        f"{i}:{'moe k=%d' % r.top_k if r.num_experts else 'dense'}" for i, r in enumerate(cf.routing)))
    print(f"{'#':>4} {'name':24} {'dtype':8} {'shape':22} {'offset':>12} {'bytes':>12} {'bits/w':>6} crc32")
    for r in cf.record_list:
        print(f"{r.index:>4} {r.name:24} {r.dtype:8} {str(list(r.shape)):22} {r.offset:>12} {r.size:>12} "
              f"{_bits(cf, r):6.2f} {r.crc32:08x}")
    mats = [r for r in cf.record_list if len(r.shape) >= 2 and not r.name.endswith(".s")]
    n = sum(int(np.prod(r.shape)) for r in mats)
    print(f"weights   {n / 1e6:.1f} M in matrices, {sum(_bits(cf, r) * int(np.prod(r.shape)) for r in mats) / n:.3f} "
          "bits per weight (a group-quantized matrix's scales counted with it)")


def _bits(cf, r) -> float:
    """Bits per element of a tensor as stored (q8/q4: with its `.s` scales)."""
    s = cf.records.get(r.name + ".s")
    return 8.0 * (r.size + (s.size if s is not None else 0)) / int(np.prod(r.shape))


def _print_rows(cf, name, rows):
    from .model.weights import first_rows
    r = cf.records[name]
    a, total = first_rows(cf, name, rows)
    print(f"{name} {r.dtype}{list(r.shape)}: first {len(a)} of {total} rows")
    with np.printoptions(precision=5, suppress=True, linewidth=120, threshold=64, edgeitems=6):
        for i, row in enumerate(a):
            print(f"[{i}] {row}")


def cmd_validate(a):
    from .model import Model
    from .model.format import ColibriFormatError
    t0 = time.perf_counter()
    try:
        m = Model.open(a.model, deep=a.deep)
    except (ColibriFormatError, FileNotFoundError) as e:
        print(f"INVALID {e.__class__.__name__}: {e}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    what = "structure, config, shapes" + (", checksums" if a.deep else "")
    print(f"OK {a.model}: {m.config.arch}, {len(m.file.record_list)} tensors, {what} "
          f"({time.perf_counter() - t0:.2f}s)")


# ---------------------------------------------------------------------------- convert

def cmd_convert(a):
    from .model.convert import ConvertError, convert
    from .model.gguf_import import convert_gguf, is_gguf
    if os.path.isdir(a.output):
        _die(f"output {a.output} is a directory; give a file name such as model.colibri")
    out_dir = os.path.dirname(os.path.abspath(a.output))
    if not os.path.isdir(out_dir):
        _die(f"output directory {out_dir} does not exist")
    t0 = time.perf_counter()
    report = None
    try:
        if os.path.isfile(a.hf_dir):
            if not is_gguf(a.hf_dir):
                _die(f"{a.hf_dir}: not a GGUF file (give a GGUF file or a Hugging Face checkpoint directory)")
            cfg, report = convert_gguf(a.hf_dir, a.output, a.dtype, name=a.name, license=a.license,
                                       require_tokenizer=not a.no_tokenizer, progress=not a.quiet,
                                       quantize=a.quantize or "auto", quantize_head=a.quantize_head,
                                       quant_group=a.quant_group, layout=a.layout)
        else:
            if a.quantize == "auto":
                _die("--quantize auto keeps a GGUF's precision; for a checkpoint directory choose none, q8, q4 or one of "
                     "llama.cpp's file types q4_k_m, q5_k_m, q6_k, q8_0, q4_0")
            errors = {}
            cfg = convert(a.hf_dir, a.output, a.dtype, name=a.name, license=a.license,
                          require_tokenizer=not a.no_tokenizer, progress=not a.quiet, quantize=a.quantize or "none",
                          quantize_head=a.quantize_head, quant_group=a.quant_group, layout=a.layout, errors=errors)
            exps = {n: e for n, e in errors.items() if "_exps" in n and not n.endswith("_b")}
            if exps:          # MXFP4 experts (GPT-OSS), re-encoded: the kernels do not run MXFP4
                worst = max(exps, key=exps.get)
                print(f"MXFP4 experts re-encoded as {cfg.quant_of('ffn_up_exps') if cfg.quant != 'none' else a.dtype}: "
                      f"relative RMS error vs the checkpoint's values mean {np.mean(list(exps.values())):.2e}, "
                      f"max {exps[worst]:.2e} ({worst})", file=sys.stderr)
    except ConvertError as e:
        _die(str(e))
    except OSError as e:          # a full disk, a read-only directory...: the partial file is removed
        _die(f"cannot write {a.output}: {e.strerror or e}" if e.filename in (None, a.output) or
             str(e.filename).startswith(out_dir) else f"{e.filename}: {e.strerror or e}")
    size = os.path.getsize(a.output)
    print(f"wrote {a.output}: {cfg.arch}, {cfg.num_layers} layers, {cfg.num_experts} experts, {a.dtype}"
          f"{' in panels' if cfg.layout == 'panels' else ''}{'' if cfg.quant == 'none' else ' + ' + cfg.quant}, "
          f"{size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if report is not None:
        print(report.summary(), file=sys.stderr)
        if cfg.quant == "q4" and report.low_bit_share > 0.5:
            print("note: q4 re-quantizes this GGUF's 4-5-bit blocks a second time (SmolLM2-135M's Q4_1: "
                  "perplexity +50% under q4, +0.7% under q8, the default); see docs/models.md", file=sys.stderr)
    if cfg.quant != "none":
        kept = sorted(k for k, q in cfg.quant_overrides.items() if q == "none")
        print(f"quantization groups of {cfg.quant_group} rows"
              + (f"; kept in {a.dtype} (rows not a multiple of {cfg.quant_group}, or an odd width for q4): "
                 f"{', '.join(kept)}" if kept else ""), file=sys.stderr)


def cmd_debug_routing(a):
    from .commands.debug import format_routing, routing_trace
    m = _open_model(a.model)
    try:
        ids, trace = routing_trace(m, [int(t) for t in a.input.split(",")] if a.token_ids else a.input)
    except ValueError as e:
        _die(str(e))
    print(format_routing(m, ids, trace))


# ---------------------------------------------------------------------------- server

DEFAULT_CONFIG = "/etc/colibri/colibri.toml"   # read by serve/config when present (--config overrides)


def setup_logging(level="info", fmt="text"):
    from .host.logs import setup
    setup(level, fmt)


def _load_settings(a):
    from .settings.load import SettingsError, load_settings
    try:
        return load_settings(a, config_path=DEFAULT_CONFIG)
    except SettingsError as e:
        _die(str(e), 2)


def use_cache_dir(path):
    """The kernel cache root for this process and those it starts (model/numba_cache reads it at import)."""
    if path:
        if "colibri_server.model.kernels" in sys.modules:   # pragma: no cover - a caller's ordering error
            raise RuntimeError("cache_dir must be set before colibri_server.model.kernels is imported")
        os.environ["COLIBRI_CACHE_DIR"] = os.path.abspath(path)


def cmd_serve(a, role="serve"):
    from .host.systemd import notifier
    from .master.arbiter import Arbiter
    from .settings.load import load_settings
    s = _load_settings(a)
    use_cache_dir(s.cache_dir)
    setup_logging(s.log_level, s.log_format)
    sys.exit(Arbiter(s, reload_settings=lambda: load_settings(a, config_path=DEFAULT_CONFIG),
                     notify=notifier(), role=role).run())


def cmd_router(a):
    cmd_serve(a, role="head")


def cmd_compile(a):
    use_cache_dir(a.cache_dir)
    from .model import precompile as P
    from .model.numba_cache import configure, kernel_dir
    try:
        layouts = tuple(a.layout or P.LAYOUTS)
        todo = ([P.Job("", "", layouts, a.kv_dtype, model=os.path.abspath(m)) for m in a.model] if a.model else
                P.jobs(a.family, None if "all" in (a.kind or ()) else a.kind or P.DEFAULT_KINDS, layouts,
                       a.kv_dtype))
    except ValueError as e:
        _die(str(e), 2)
    for m in a.model or ():
        problem = model_file_problem(m)
        if problem:
            _die(problem)
    where = configure() or kernel_dir()
    print(f"colibri compile: {len(todo)} jobs into {where}", file=sys.stderr, flush=True)
    t0, total = time.perf_counter(), [0]

    def progress(i, n, r):
        job, secs, compiled, error = r
        total[0] += compiled
        print(f"colibri compile: [{i}/{n}] {job.name}: " + (f"failed: {error}" if error else
              f"{compiled} kernels compiled in {secs:.1f}s"), file=sys.stderr, flush=True)
    failed = [r for r in P.compile_jobs(todo, a.jobs, progress) if r[3]]
    print(f"colibri compile: {total[0]} kernels compiled for {len(todo) - len(failed)} of {len(todo)} jobs in "
          f"{time.perf_counter() - t0:.1f}s; cache {where}", file=sys.stderr)
    if failed:
        sys.exit(1)


def cmd_config(a):
    from .settings.load import describe
    print(describe(_load_settings(a)))


def _client(a):
    from .client import Client
    try:
        return Client(a.connect, timeout=a.timeout)
    except ValueError as e:
        _die(f"--connect: {e}", 2)


def cmd_generate(a):
    from .client import ColibriError
    from .commands.chat import ChatError, messages_for, model_info_of_server, render
    params = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                  seed=a.seed, stop=a.stop or None, ignore_eos=a.ignore_eos or None)
    if a.system is not None and not a.chat:
        _die("--system goes with --chat", 2)
    try:
        with _client(a) as c:
            prompt = a.prompt
            if a.chat:
                prompt = c.tokenize(*render(model_info_of_server(c), messages_for(a.prompt, a.system)))
            last = None
            for chunk in c.stream(prompt, **params):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
    except ColibriError as e:
        _die(f"{e.code}: {e.message}")
    except ChatError as e:
        _die(str(e))
    sys.stdout.write("\n")
    if last is not None and last.usage:
        t = last.timings or {}
        print(f"[{last.finish_reason}; {last.usage.get('completion_tokens')} tokens; worker {last.worker_pid}, "
              f"generation {last.generation}; queued {t.get('queued_s', 0):.3f}s, total {t.get('total_s', 0):.3f}s]",
              file=sys.stderr)


def cmd_status(a):
    from .client import ColibriError
    try:
        with _client(a) as c:
            st = c.stats()
    except ColibriError as e:
        _die(f"{e.code}: {e.message}")
    from .commands.status import format_status
    print(json.dumps(st, indent=1) if a.json else format_status(st))


def cmd_demo(a):
    """Start a server with 2 workers on the bundled model, ask it one thing, show memory, stop."""
    from .commands.demo import run
    model = default_model_path(a.model)
    problem = model_file_problem(model)
    if problem:
        _die(problem, EXIT_LOAD)
    run(a, model, _die)


_LAYOUT_HELP = ("how f16/bf16 matrices are stored: panels of 256 columns (faster decode) or rows "
                "(default: panels for f16; rows for bf16, where prefill_bf16 is a few %% faster)")


def cmd_dequantize(a):
    from .model.convert import ConvertError
    from .model.format import ColibriFormatError
    from .model.quant import dequantize_file
    if not os.path.exists(a.input):
        _die(f"model file not found: {a.input}")
    try:
        dequantize_file(a.input, a.output, a.dtype, layout=a.layout)
    except (ColibriFormatError, ConvertError, ValueError) as e:
        _die(str(e))
    print(f"wrote {a.output} ({a.dtype})", file=sys.stderr)


# ---------------------------------------------------------------------------- main

class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (when it has one worth showing)."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if ("%(default)" in h or "default" in h.lower() or not action.option_strings or d is None
                or d is argparse.SUPPRESS or isinstance(d, bool) or d == []):
            return h
        return h + " (default: %(default)s)"


def _describe_subcommands(p: argparse.ArgumentParser):
    """Each subcommand's --help opens with its one-line help as a description."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sp in action.choices.items():
                if not sp.description and helps.get(name):
                    sp.description = helps[name]
                sp.formatter_class = _HelpFormatter
                _describe_subcommands(sp)


def _version() -> str:
    from . import __version__
    try:
        from importlib.metadata import version
        v = version("colibri-server")
    except Exception:
        v = __version__
    import platform
    return f"colibri {v} (Python {platform.python_version()})"


def _chat_arguments(p):
    p.add_argument("--chat", action="store_true", help="the prompt is a user's message: send it through the "
                   "model's chat template, so that an instruct model answers it")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")


def _sampling_arguments(p, max_tokens: int, max_help: str) -> None:
    """The sampling flags `run` and `chat` share."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=max_help)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalty on tokens already seen (1: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def build_parser() -> argparse.ArgumentParser:
    from .settings.parser import Parser
    p = Parser(prog="colibri", description="CPU inference server for Mixture-of-Experts models",
                                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    from .settings.load import add_arguments

    sv = sub.add_parser("serve", help="serve a model: master, router and pre-forked workers")
    add_arguments(sv)
    sv.set_defaults(fn=cmd_serve)

    ro = sub.add_parser("router", help="a head: a router with no workers of its own, serving through worker "
                                       "hosts (`colibri serve --join`) that connect to --backend-bind")
    add_arguments(ro)
    ro.set_defaults(fn=cmd_router)

    cf = sub.add_parser("config", help="show the effective settings and where each came from")
    cf.add_argument("--print", action="store_true", help="print every setting (the default action)")
    add_arguments(cf)
    cf.set_defaults(fn=cmd_config)

    g = sub.add_parser("generate", help="send a prompt to a running server and stream the answer")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--connect", default="tcp://127.0.0.1:5555", metavar="ADDRESS",
                   help="the server's address: tcp://HOST:PORT or ipc:///PATH")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: the server's, 1)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens "
                                                               "(default: the server's, 0 = all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="longest wait for the next message (no server: fails after 3 s)")
    _chat_arguments(g)
    g.set_defaults(fn=cmd_generate)

    from .wire.security import add_keys_parser
    add_keys_parser(sub)
    from .http import add_http_arguments, cmd_http
    add_http_arguments(sub.add_parser("http", help="OpenAI-compatible HTTP gateway (gunicorn) to a running server")
                       ).set_defaults(fn=cmd_http)

    dm = sub.add_parser("demo", help="serve the bundled model with 2 workers, send one request, show memory, stop")
    dm.add_argument("--model", default=None, help="a .colibri file (default: the bundled tiny model)")
    dm.add_argument("--workers", type=int, default=2, help="worker processes to start")
    dm.add_argument("--prompt", default="def fibonacci(n):", help="what to ask")
    dm.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    dm.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    dm.set_defaults(fn=cmd_demo)

    st = sub.add_parser("status", help="workers, pids, cores, generation, queue and memory of a running server")
    st.add_argument("--connect", default="tcp://127.0.0.1:5555", metavar="ADDRESS",
                    help="the server's address: tcp://HOST:PORT or ipc:///PATH")
    st.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    st.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="longest wait for the answer")
    st.set_defaults(fn=cmd_status)

    r = sub.add_parser("run", help="generate from a prompt in this process (streams text)")
    r.add_argument("prompt", nargs="?", help="the prompt text (or token ids with --token-ids)")
    r.add_argument("--model", default=None, help="path to a .colibri file (default: the bundled tiny model)")
    _sampling_arguments(r, 64, "most tokens to generate")
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    r.add_argument("--context", type=int, default=None, help="KV cache capacity in tokens (default: the model's)")
    r.add_argument("--routing-noise", type=float, default=0.0, help="Gumbel top-k routing noise scale (0: off)")
    r.add_argument("--exact-head", action=argparse.BooleanOptionalAction, default=True,
                   help="a block-kind output head on the hidden state rounded to int16 (the default); "
                        "--no-exact-head: llama.cpp's int8 rounding of it (exact_head)")
    r.add_argument("--prefill-bf16", action="store_true",
                   help="prefill bf16 weights with bf16-rounded activations (avx512bf16 CPUs: ~2x faster prefill)")
    r.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids; print ids")
    r.add_argument("--embedding", help="a .npy file of input embeddings (T, D): bypasses the tokenizer")
    _chat_arguments(r)
    r.set_defaults(fn=cmd_run)

    ch = sub.add_parser("chat", help="a conversation with an instruct model in this process: one message a line, "
                                     "through the model's chat template")
    ch.add_argument("--model", default=None, help="path to a .colibri file with a chat template")
    ch.add_argument("--system", default=None, metavar="TEXT", help="a system message first")
    _sampling_arguments(ch, 512, "most tokens in one answer")
    ch.add_argument("--context", type=int, default=None, help="KV cache capacity in tokens (default: the model's)")
    ch.add_argument("--prefill-bf16", action="store_true", help="prefill bf16 weights with bf16-rounded activations")
    ch.add_argument("--exact-head", action=argparse.BooleanOptionalAction, default=True,
                    help="a block-kind output head on the hidden state rounded to int16 (the default); "
                         "--no-exact-head: llama.cpp's int8 rounding of it (exact_head)")
    ch.set_defaults(fn=cmd_chat)

    k = sub.add_parser("compile", help="compile the CPU kernels ahead of time, once per machine (every "
                                       "family and storage kind, or what --model files need)")
    k.add_argument("--model", action="append", metavar="FILE", help="compile what this .colibri file needs "
                   "(repeatable) instead of every family and kind")
    k.add_argument("--family", action="append", metavar="NAME", help="only these families (repeatable)")
    k.add_argument("--kind", action="append", metavar="NAME", help="only these storage kinds (repeatable; default "
                   "the kinds `colibri convert` writes by default: f16-panels, bf16, q8, q4, blocks (a quantized GGUF's "
                   "llama.cpp block kinds, any mix); all: f16 rows and bf16-panels too)")
    k.add_argument("--layout", action="append", choices=("run", "serve-1", "serve-n", "prefill"), help="only "
                   "these ways of running (repeatable; default all: `colibri run`, one-thread workers, threaded "
                   "workers; prefill: run's prompt kernels alone)")
    k.add_argument("--kv-dtype", choices=("f16", "f32"), default="f16", help="the servers' KV cache precision")
    k.add_argument("--jobs", type=int, default=0, metavar="N", help="processes compiling at once (0: one per core)")
    k.add_argument("--cache-dir", default=os.environ.get("COLIBRI_CACHE_DIR", ""), metavar="DIR",
                   help="the kernel cache (default: $CACHE_DIRECTORY, else $XDG_CACHE_HOME/colibri, "
                        "else ~/.cache/colibri)")
    k.set_defaults(fn=cmd_compile)

    d = sub.add_parser("debug", help="look inside a model")
    dsub = d.add_subparsers(dest="what", required=True)
    dr = dsub.add_parser("routing", help="per token and layer: the top-k experts and weights; expert load")
    dr.add_argument("--model", default=None, help="a .colibri file (default: the bundled model)")
    dr.add_argument("--input", required=True, help="the text to route (or ids with --token-ids)")
    dr.add_argument("--token-ids", action="store_true", help="the input is comma-separated token ids")
    dr.set_defaults(fn=cmd_debug_routing)

    i = sub.add_parser("inspect", help="header, config, metadata, tensor table; rows of one tensor")
    i.add_argument("model", help="a .colibri file")
    i.add_argument("--tensor", metavar="NAME", help="print the first rows of this tensor")
    i.add_argument("--gate", type=int, metavar="LAYER", help="print the router gate of LAYER")
    i.add_argument("--rows", type=int, default=4, help="rows to print with --tensor or --gate")
    i.add_argument("--json", action="store_true", help="header, config, metadata and tensor table as JSON")
    i.set_defaults(fn=cmd_inspect)

    v = sub.add_parser("validate", help="validate a model file (exit 0 if valid, 1 with the named error)")
    v.add_argument("model", help="a .colibri file")
    v.add_argument("--deep", action="store_true", help="also verify every tensor checksum")
    v.set_defaults(fn=cmd_validate)

    c = sub.add_parser("convert", help="Hugging Face safetensors checkpoint directory, or a llama.cpp GGUF "
                                       "file -> .colibri")
    c.add_argument("hf_dir", metavar="source", help="the checkpoint directory (config.json, *.safetensors, "
                                                     "tokenizer.json) or a .gguf file")
    c.add_argument("output", help="the .colibri file to write")
    c.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f16", help="precision of the float tensors")
    c.add_argument("--name", help="model name in the metadata (default: the directory's name)")
    c.add_argument("--license", help="license string in the metadata")
    c.add_argument("--no-tokenizer", action="store_true", help="convert without tokenizer.json (token ids only)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--quantize", default=None, metavar="KIND",
                   help="none, q8 or q4: group-quantize the attention projections, experts and output head "
                        "(docs/format.md); default none for a checkpoint, auto for a GGUF (float -> none, quantized -> "
                        "blocks); blocks keeps a GGUF's quantized tensors in their own llama.cpp block types, at the "
                        "GGUF's size; q4_k_m, q5_k_m, q6_k, q8_0 or q4_0 (a checkpoint): its matrices in llama.cpp's "
                        "block types, mixed per tensor as llama-quantize mixes that file type")
    c.add_argument("--quantize-head", choices=("none", "q8", "q4"), default=None,
                   help="the output head's precision (default: q8 under q4, else as --quantize)")
    c.add_argument("--quant-group", type=int, choices=(8, 16, 32, 64, 128), default=None,
                   help="rows sharing one scale per column (default 64; a matrix whose rows are not a "
                        "multiple stays unquantized)")
    c.add_argument("--layout", choices=("rows", "panels"), default=None, help=_LAYOUT_HELP)
    c.set_defaults(fn=cmd_convert)

    dq = sub.add_parser("dequantize", help="write a float copy of a quantized .colibri file")
    dq.add_argument("input", help="a quantized .colibri file")
    dq.add_argument("output", help="the .colibri file to write")
    dq.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f16", help="precision of the float copy")
    dq.add_argument("--layout", choices=("rows", "panels"), default=None, help=_LAYOUT_HELP)
    dq.set_defaults(fn=cmd_dequantize)
    _describe_subcommands(p)
    return p


def main(argv=None):
    from .host.logs import claim_title
    claim_title()                   # before anything changes the environment
    a = build_parser().parse_args(argv)
    try:
        a.fn(a)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()

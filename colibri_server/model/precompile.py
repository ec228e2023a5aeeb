"""Every kernel a server on this machine can need, compiled ahead of time into the kernel cache.

A kernel's compiled type depends on the kinds of its arrays (f16 rows or panels, bf16, q8, q4), on
a family's pieces (q|k|v heads or latent attention, routed or dense layers, GPT-OSS's biased experts)
and on the thread layout (one thread, or rows split over several), never on a model's shape
(kernels/stacks). So a small model of random weights (synthetic.py) of each family and kind, warmed
up the ways the roles warm a model up, compiles what any model of that family and kind needs:

  run      Model.warm_up: `colibri run`'s decode on a sequence's own cache, one thread
  prefill  run's kernels of a prompt of several tokens, without its fused token: what a first `colibri run`
           leaves to a second process (start_other_layouts) while it compiles that token itself
  serve-1  serving.warm_up with one-thread workers: the batched step, the fused token on the pool
  serve-n  serving.warm_up and compile_threaded with threaded workers (their kernels compiled, not run)

`colibri compile` runs the jobs (family x kind, each every layout) on a pool of processes, one per
core, into the one cache (numba_cache: the directory and its locked saves); the first job runs
alone, so that the kernels every job shares compile once. A model file instead of the families
compiles exactly what that model needs (`--model`).

What stays specific to a model: nothing of its shape in the fused token (its stacks), and elsewhere only
where a view's layout follows from a coincidence of sizes (a slice that is the whole row is C-ordered, a
narrower one not): each job warms two models of other sizes (_WIDE), so that both forms compile; a model
whose sizes meet a third coincidence compiles what it meets at its first start (measured, before the second
model: one conversion kernel, 0.3-0.5 s, for a 30-layer and an 8-layer f16 model; a block model of other
sizes, 48 kernels).

Names in FAMILIES are the model families of config.ARCHITECTURES that differ in their kernels' types:
the others (qwen3_moe, olmoe, granitemoe, qwen2, qwen3) reach the same signatures as one listed here
(q/k norms, clips and biases are data, not types).
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["FAMILIES", "KINDS", "DEFAULT_KINDS", "LAYOUTS", "PREFILL", "Job", "jobs", "run_job", "compile_jobs", "start_other_layouts"]

_BASE = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
             num_experts=4, top_k=2, moe_intermediate_size=512, rms_norm_eps=1e-5, max_position_embeddings=512,
             rope_theta=1e4, bos_token_id=1, eos_token_ids=(2,))

# the second model of a job: other sizes, so that a view that is a whole row in one (C-ordered) is a narrower slice
# in the other, and the reverse (q heads as wide as the model here, not in _BASE)
_WIDE = dict(hidden_size=512, num_layers=3, vocab_size=640)
_FFN, _WIDE_FFN = ("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size"), 768

# each family's pieces that change a kernel's types (sizes: columns whole panels, rows whole quant groups)
FAMILIES = {
    "mixtral": dict(arch="mixtral"),
    "qwen2_moe": dict(arch="qwen2_moe", qkv_bias=True, shared_expert_intermediate_size=512, intermediate_size=512,
                      dense_layers=(1,)),
    "glm4_moe": dict(arch="glm4_moe", score_func="sigmoid", correction_bias=True, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, shared_expert_intermediate_size=512, shared_expert_gate=False,
                     intermediate_size=512, dense_layers=(0,), qk_norm="head", rotary_dim=32),
    "deepseek2": dict(arch="deepseek2", num_kv_heads=1, head_dim=32, kv_lora_rank=256, q_lora_rank=256,
                      qk_nope_head_dim=64, v_head_dim=64, score_func="sigmoid", correction_bias=True, n_group=2,
                      topk_group=1, shared_expert_intermediate_size=512, shared_expert_gate=False,
                      intermediate_size=512, dense_layers=(0,)),
    "gpt_oss": dict(arch="gpt_oss", qkv_bias=True, o_bias=True, attn_sinks=True, router_bias=True, expert_bias=True,
                    sliding_window=8, sliding_layers=(0,), swiglu_limit=7.0, swiglu_alpha=1.702),
    "phimoe": dict(arch="phimoe", norm="layer", output_bias=True, sparsemixer_eps=0.01, norm_topk_prob=False,
                   qkv_bias=True, o_bias=True),
    "llama": dict(arch="llama", num_experts=0, top_k=0, moe_intermediate_size=0, intermediate_size=512,
                  dense_layers=(0, 1)),
}

# storage kinds, as `colibri convert` writes them (q4: its head in q8, as --quantize q4 does by default)
KINDS = {
    "f16": dict(dtype="f16"),
    "f16-panels": dict(dtype="f16", layout="panels"),
    "bf16": dict(dtype="bf16"),
    "bf16-panels": dict(dtype="bf16", layout="panels"),
    "q8": dict(dtype="f16", quant="q8"),
    "q4": dict(dtype="f16", quant="q4", quant_overrides={"output": "q8"}),
    # llama.cpp's block kinds, as a GGUF converts by default (--quantize auto) or `convert --quantize q4_k_m`
    # writes: a matrix's kind (q4_k, q6_k, q8_0, mxfp4, ...) is an integer argument of the block kernels,
    # never a type, so this one mix compiles what a file of any mix of them needs
    "blocks": dict(dtype="f16", layout="panels", scheme="q4_k_m"),
}

# what `colibri compile` builds without --kind: the kinds `colibri convert` writes unless told otherwise (f16 in
# panels, bf16 in rows: convert.default_layout; --quantize q8 or q4; a quantized GGUF's blocks). f16 rows and bf16 panels, written only on
# request (--layout), take their name or "all" (bf16-panels is the longest: 250 s a job on 2 shared cores)
DEFAULT_KINDS = ("f16-panels", "bf16", "q8", "q4", "blocks")

LAYOUTS = ("run", "serve-1", "serve-n")
PREFILL = "prefill"         # a part of "run" (see the module's doc); not a layout of its own in `colibri compile`


@dataclass(frozen=True)
class Job:
    family: str            # a FAMILIES name, or "" with `model` set
    kind: str              # a KINDS name, or "" with `model` set
    layouts: tuple = LAYOUTS
    kv_dtype: str = "f16"
    model: str = ""        # a model file: compile what it needs

    @property
    def name(self) -> str:
        return os.path.basename(self.model) if self.model else f"{self.family} {self.kind}"


def jobs(families=None, kinds=None, layouts=LAYOUTS, kv_dtype="f16") -> list:
    """The jobs for these families and kinds (all by default), the most shared one first."""
    fs, ks = families or list(FAMILIES), kinds or list(KINDS)
    for n in fs:
        if n not in FAMILIES:
            raise ValueError(f"unknown family {n!r}: one of {', '.join(FAMILIES)}")
    for n in ks:
        if n not in KINDS:
            raise ValueError(f"unknown kind {n!r}: one of {', '.join(KINDS)}")
    return [Job(f, k, tuple(layouts), kv_dtype) for k in ks for f in fs]


def _config(job: Job, wide: bool = False):
    """The job's small model; `wide`: the same of other sizes (module doc: a view's layout by coincidence)."""
    from dataclasses import replace

    from .config import ModelConfig
    from .kquants import scheme_kinds
    kind = dict(KINDS[job.kind])
    scheme = kind.pop("scheme", "")
    cfg = ModelConfig(**{**_BASE, **FAMILIES[job.family], **kind})
    if wide:
        cfg = replace(cfg, **_WIDE, **{k: _WIDE_FFN for k in _FFN if getattr(cfg, k)},
                      dense_layers=tuple(range(_WIDE["num_layers"])) if not cfg.num_experts else cfg.dense_layers)
    return replace(cfg, block_types=scheme_kinds(cfg, scheme)) if scheme else cfg


def _warm(m, layout: str, kv_dtype: str) -> None:
    from . import serving
    from .transformer import Workspace
    if layout == "run":
        m.warm_up()
    elif layout == PREFILL:
        bos = max(m.config.bos_token_id, 0)
        m.prefill(m.new_cache(8), np.array([bos, bos], np.int64))
    elif layout == "serve-1":
        m.warm_up(run=lambda: serving.warm_up(m, kv_dtype, 1))
    else:
        m.warm_up(run=lambda: serving.warm_up(m, kv_dtype, 2))
        # a real model's matrices run on threads above PAR_MIN_WEIGHTS and on the calling thread below it:
        # both forms for every matrix of this small one
        keep = Workspace.PAR_MIN_WEIGHTS
        try:
            for threshold in (0, 1 << 62):
                Workspace.PAR_MIN_WEIGHTS = threshold
                serving.compile_threaded(m, kv_dtype)
        finally:
            Workspace.PAR_MIN_WEIGHTS = keep


def run_job(job: Job) -> tuple:
    """Compile (or load from the cache) every kernel of one job -> (job, seconds, kernels compiled, error: ""
    or one line saying what failed)."""
    t0 = time.perf_counter()
    try:
        return (job, *_run(job), "")
    except Exception as e:          # a bad model file, a config this build rejects: named, the other jobs go on
        return job, time.perf_counter() - t0, 0, f"{type(e).__name__}: {e}"


def _run(job: Job) -> tuple:
    from .engine import Model
    from .numba_cache import Compiles
    from .synthetic import write_synthetic
    t0 = time.perf_counter()
    with Compiles() as compiled:
        with tempfile.TemporaryDirectory(prefix="colibri-compile-") as d:
            paths = [job.model] if job.model else []
            for wide in (() if job.model else (False, True)):
                paths.append(os.path.join(d, f"m{int(wide)}.colibri"))
                write_synthetic(paths[-1], _config(job, wide))
            for path in paths:
                m = Model.open(path, context=None if job.model else 512)   # > the few-row kernels' limit (serving.warm_up)
                try:
                    for layout in job.layouts:
                        _warm(m, layout, job.kv_dtype)
                finally:
                    m.close()
    return time.perf_counter() - t0, compiled.count


def compile_jobs(todo, procs: int = 0, progress=None) -> list:
    """Run the jobs, the first alone and the rest on `procs` processes (0: one per core); progress(i, n, result)
    after each. Returns the results in the order they finished."""
    import multiprocessing as mp
    procs = procs or len(os.sched_getaffinity(0))
    done, n = [], len(todo)
    if not todo:
        return done
    ctx = mp.get_context("spawn")          # a fresh interpreter: no forked Numba threads, no inherited state
    with ctx.Pool(min(procs, n), maxtasksperchild=4) as pool:
        first = pool.apply(run_job, (todo[0],))
        done.append(first)
        if progress:
            progress(1, n, first)
        for r in pool.imap_unordered(run_job, todo[1:]):
            done.append(r)
            if progress:
                progress(len(done), n, r)
    return done


def start_other_layouts(model_path: str, own: str, kv_dtype: str = "f16"):
    """A `colibri compile --model` process for the layouts other than `own`, started beside a first start
    that is compiling its own (Numba compiles on one core; this takes another). For `own` "run" it compiles
    run's prompt kernels first (PREFILL), which that start, compiling its fused token first (Model.warm_up),
    then finds in the cache: a cold `colibri run` waits for the longer of the two parts, not their sum. Then
    the other layouts, so that `colibri serve` after `colibri run` starts warm. Returns the Popen (its output
    discarded; the caller waits)."""
    import subprocess
    import sys
    args = [sys.executable, "-m", "colibri_server.cli", "compile", "--model", model_path, "--kv-dtype", kv_dtype,
            "--jobs", "1"]
    for layout in ((PREFILL,) if own == "run" else ()) + LAYOUTS:
        if layout != own:
            args += ["--layout", layout]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

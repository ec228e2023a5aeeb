"""The model core: the .colibri format, the converter, the forward pass, and the API the roles use.

`Model` (engine.py) is the face: open a file, prefill/decode/stream, plus what the cli needs
(`generate_from_embeddings`, `weights.first_rows`). Below it: transformer/moe/decode_step (one
sequence), batch/head/kv/scheduler/serving (many), weights/panels/quant (views of the mapping),
format (bytes) and hugepages (pages), convert (HF -> .colibri), kernels/ (every Numba loop).
It never imports the roles (master, router, worker), the wire (protocol, client) or the gateway.
Importing it imports neither the engine nor the kernels (nor Numba): `Model` and its kin load on first use.
"""
from . import hugepages as _hugepages  # noqa: F401  (installs the 2 MiB page policy into format)
from .format import ColibriFormatError  # noqa: F401

_LAZY = {"Model": "engine", "Completion": "engine", "StreamEvent": "engine"}


def __getattr__(name):
    # the engine (and through it Numba and LLVM, ~80 MiB) only when asked for: the router and the gateway import
    # the tokenizer, the grammar and the format from here and never run a kernel. The kernels' cache is set up
    # by kernels/__init__, before the first kernel module
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

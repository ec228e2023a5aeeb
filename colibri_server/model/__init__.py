"""The model core: the .colibri format, the converter, the forward pass, and the API the roles use.

`Model` (engine.py) is the face: open a file, prefill/decode/stream, plus what the cli needs
(`generate_from_embeddings`, `weights.first_rows`). Below it: transformer/moe/decode_step (one
sequence), batch/kv/scheduler/serving (many), weights/panels/quant (views of the mapping),
format (bytes) and hugepages (pages), convert (HF -> .colibri), kernels/ (every Numba loop).
It never imports the roles (master, router, worker), the wire (protocol, client) or the gateway.
"""
from . import numba_cache as _numba_cache

_numba_cache.configure()    # before any kernel module is imported: the machine's and build's own cache directory
_numba_cache.lock_saves()   # and two processes compiling at once never cross their cache entries

from . import hugepages as _hugepages  # noqa: E402,F401  (installs the 2 MiB page policy into format)
from .engine import Completion, Model, StreamEvent  # noqa: E402,F401
from .format import ColibriFormatError  # noqa: E402,F401

"""The model core: the .colibri format, the converter, and the forward pass."""
from . import numba_cache as _numba_cache

_numba_cache.refresh()      # before any kernel module is imported: a stale cached kernel never loads

from . import hugepages as _hugepages  # noqa: E402,F401  (installs the 2 MiB page policy into format)

from .engine import Completion, Model, StreamEvent  # noqa: E402,F401
from .format import ColibriFormatError  # noqa: E402,F401

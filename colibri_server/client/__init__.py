"""The Python client of a colibri server: `Client` (synchronous, one per thread) and `AsyncClient`
(one per event loop), over one router or a `RouterSet` of several; the answers' types and the
errors, one class per protocol error code.

    from colibri_server.client import Client
    with Client("tcp://127.0.0.1:5555", timeout=30) as c:
        print(c.generate("Once upon a time", max_tokens=32).text)
"""

from .aio import AsyncClient, AsyncStream
from .pool import RouterSet, failure_cause, merge_health, parse_addresses
from .sync import Client, Stream
from .types import (
                    ERRORS,
                    BadRequest,
                    Cancelled,
                    Choice,
                    Chunk,
                    ColibriError,
                    ColibriTimeout,
                    Completion,
                    ConnectionLost,
                    DeadlineExceeded,
                    DuplicateId,
                    InternalError,
                    NotFound,
                    NumericalFault,
                    Overloaded,
                    ShuttingDown,
                    Starting,
                    TooLarge,
                    Unauthorized,
                    UnknownType,
                    Unreachable,
                    UnsupportedVersion,
                    WorkerLost,
                    error_for,
)

__all__ = [
    "Client", "AsyncClient", "RouterSet", "merge_health", "parse_addresses", "failure_cause",
    "Completion", "Chunk", "Choice", "Stream", "AsyncStream",
    "ColibriError", "ColibriTimeout", "ERRORS", "error_for",
    "BadRequest", "UnsupportedVersion", "UnknownType", "TooLarge", "Overloaded",
    "DeadlineExceeded", "Cancelled", "WorkerLost", "ShuttingDown", "Starting", "DuplicateId",
    "NotFound", "Unauthorized", "InternalError", "Unreachable", "NumericalFault", "ConnectionLost",
]

"""What the client hands back: one exception class per protocol error code, Completion and
Chunk. Re-exported by colibri_server.client; kept apart so the client module holds I/O only."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..wire import protocol

# ---------------------------------------------------------------------------- errors


def _rebuild_error(cls, message, code, request_id):
    return cls(message, code=code, request_id=request_id)


class ColibriError(Exception):
    """An error answered by the server (or detected by the client).

    `code` is one of `protocol.ERROR_CODES` (a code unknown to this client, from a newer
    server, gives a plain ColibriError carrying that code), or "timeout" for ColibriTimeout.
    Switch on the class or on `code`, never on `message`.
    """

    code: Optional[str] = None

    def __init__(self, message: str = "", *, code: Optional[str] = None, request_id=None):
        if code is not None:
            self.code = code
        self.message = message
        self.request_id = request_id
        super().__init__(message)

    def __str__(self):
        rid = f" (request {self.request_id!r})" if self.request_id is not None else ""
        return f"{self.code}: {self.message}{rid}"

    def __repr__(self):
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, request_id={self.request_id!r})"

    def __reduce__(self):
        return _rebuild_error, (type(self), self.message, self.code, self.request_id)


class BadRequest(ColibriError):
    code = "bad_request"


class UnsupportedVersion(ColibriError):
    code = "unsupported_version"


class UnknownType(ColibriError):
    code = "unknown_type"


class TooLarge(ColibriError):
    code = "too_large"


class Overloaded(ColibriError):
    code = "overloaded"


class DeadlineExceeded(ColibriError):
    code = "deadline_exceeded"


class Cancelled(ColibriError):
    """The server cancelled the request before it started (a request cancelled while
    running ends normally instead, with finish_reason "cancelled")."""
    code = "cancelled"


class WorkerLost(ColibriError):
    code = "worker_lost"


class NumericalFault(ColibriError):
    """The forward pass gave non-finite logits (corrupted weights or an overflow); the server
    logged the layer. Retrying the same request gives the same fault."""
    code = "numerical_fault"


class ShuttingDown(ColibriError):
    code = "shutting_down"


class Starting(ColibriError):
    """The server is still loading its model (and compiling its kernels): nothing was started;
    retry shortly (or another router)."""
    code = "starting"


class DuplicateId(ColibriError):
    code = "duplicate_id"


class NotFound(ColibriError):
    code = "not_found"


class Unauthorized(ColibriError):
    """The server no longer allows this client's CURVE key (it was removed on a reload)."""
    code = "unauthorized"


class InternalError(ColibriError):
    """A server bug, or a malformed message from the server (detected by the client)."""
    code = "internal"


class ColibriTimeout(ColibriError):
    """No message for the request arrived within the client's timeout (client-side)."""
    code = "timeout"


class ConnectionLost(ColibriError):
    """The connection to the server dropped while the request was in flight (client-side): the
    router that held it is gone (it restarts); its answer will never come. Safe to retry."""
    code = "connection_lost"


class Unreachable(ColibriTimeout):
    """No connection to the server could be made within the client's connect_timeout; the
    message names the address and the likely cause (nothing listening, a missing ipc socket
    file, a CURVE handshake that never completes). Client-side, like ColibriTimeout."""
    code = "unreachable"


ERRORS = {cls.code: cls for cls in (
    BadRequest, UnsupportedVersion, UnknownType, TooLarge, Overloaded, DeadlineExceeded,
    Cancelled, WorkerLost, NumericalFault, ShuttingDown, Starting, DuplicateId, NotFound, Unauthorized, InternalError)}
assert set(ERRORS) == set(protocol.ERROR_CODES), "client.ERRORS is out of date with protocol.ERROR_CODES"


def error_for(code, message="", request_id=None) -> ColibriError:
    """The exception instance for an error code (unknown codes -> ColibriError)."""
    cls = ERRORS.get(code, ColibriError)
    return cls(message, code=code, request_id=request_id)


def _internal(message, request_id=None) -> InternalError:
    return InternalError(message, code="internal", request_id=request_id)


# ---------------------------------------------------------------------------- results


@dataclass
class Choice:
    """One of a generate's n completions. logprobs (when asked): one entry per token,
    [token text, logprob, [[id, token text, logprob], ...top alternatives]] (see protocol)."""
    index: int
    text: str
    token_ids: list
    finish_reason: str
    logprobs: Optional[list] = None


@dataclass
class Completion:
    """The whole answer to a generate: text, token_ids, finish_reason and logprobs are the first
    completion's; `choices` holds all n (n = 1: just that one); usage counts them all."""
    text: str
    token_ids: list
    finish_reason: str
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    generation: Optional[int] = None
    worker_pid: Optional[int] = None
    id: Any = None
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None        # one entry per prompt token, the first's logprob None
    choices: list = field(default_factory=list)
    request_id: Optional[str] = None              # the server's name for it in its logs (given or generated)


@dataclass
class Chunk:
    """One streamed piece.  The last chunk of a stream is built from the server's "done":
    it has `finish_reason` (and usage, timings, generation, worker_pid) set, and its text/ids
    are whatever "done" carries beyond what was already streamed (usually nothing)."""
    text: str
    token_ids: list
    index: int
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None
    generation: Optional[int] = None
    worker_pid: Optional[int] = None
    choice: int = 0                           # which of the n completions this piece belongs to
    logprobs: Optional[list] = None           # one entry per id (when asked)
    choices: Optional[list] = None            # the final chunk: every completion (Choice)
    prompt_logprobs: Optional[list] = None    # the first token's chunk and the final chunk, when asked
    request_id: Optional[str] = None          # the final chunk: the request's id in the server's logs

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


# ---------------------------------------------------------------------------- message interpretation


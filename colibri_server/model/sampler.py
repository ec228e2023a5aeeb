"""Token sampling and stop-condition handling.

Three pieces, all pure NumPy / pure Python and independent of the model:

* :class:`SamplingParams` -- the per-request knobs (frozen, validated).
* :class:`Sampler` -- turns one row of logits into one token id.  The order of
  operations follows vLLM's: logit bias, repetition penalty (Hugging Face's, on
  the prompt and the completion), presence and frequency penalties (OpenAI's, on
  the completion), then (unless greedy) temperature, top-k, top-p, min-p,
  renormalise, draw.
* :func:`token_logprobs` -- the log-probability of a token and the top
  alternatives, from the model's raw logits (before any of the above: what
  vLLM returns by default and what a log-softmax of ``Model.logits`` gives).
* :class:`StopChecker` -- stop strings / stop token ids / EOS for a streaming
  server, holding back text that might still turn into a stop string.

The sampler is written to be cheap for vocabularies of ~32k-256k entries: it
never sorts the whole vocabulary in the common cases (top-k uses a partial
partition; top-p first looks for the nucleus among the few high-probability
tokens, whose count is bounded by pigeonhole), and the final draw uses a
two-level (block) inverse CDF instead of a full cumulative sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..sampling_fields import MAX_LOGPROBS, SAMPLING_FIELDS

__all__ = ["SamplingParams", "Sampler", "StopChecker", "token_logprobs", "MAX_LOGPROBS"]

_D = {name: f.default for name, f in SAMPLING_FIELDS.items()}     # the one table's defaults


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
        x, (bool, np.bool_)
    )


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters.

    ``temperature == 0`` means greedy decoding (argmax); ``top_k == 0``,
    ``top_p == 1`` and ``min_p == 0`` switch the respective filter off;
    ``repetition_penalty == 1`` switches the penalty off.  ``presence_penalty`` and
    ``frequency_penalty`` follow OpenAI: the logit of a token already sampled c times
    in this completion drops by ``c * frequency_penalty + presence_penalty``.
    ``logit_bias`` adds a bias to given token ids (a mapping or ``(id, bias)`` pairs;
    stored as sorted pairs).  ``logprobs`` / ``prompt_logprobs``: None, or how many
    top alternatives (0..MAX_LOGPROBS) to report beside each sampled / prompt
    token's own log-probability (the sampler does not compute them; the caller
    does, with :func:`token_logprobs`).  ``stop`` holds stop
    *strings* (excluded from the output, as in OpenAI's API); ``stop_token_ids``
    are extra token ids that end generation (EOS ids come from the tokenizer
    and are honoured unless ``ignore_eos``).

    Validation runs in ``__post_init__`` (so an invalid instance cannot exist)
    and raises :class:`ValueError` whose message starts with the field name.
    Lists given for ``stop`` / ``stop_token_ids`` are converted to tuples; a
    single string for ``stop`` becomes a one-element tuple.
    """

    temperature: float = _D["temperature"]
    top_k: int = _D["top_k"]
    top_p: float = _D["top_p"]
    min_p: float = _D["min_p"]
    repetition_penalty: float = _D["repetition_penalty"]
    seed: int | None = _D["seed"]
    max_tokens: int = _D["max_tokens"]
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = _D["ignore_eos"]
    presence_penalty: float = _D["presence_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    logit_bias: tuple = ()
    logprobs: int | None = _D["logprobs"]
    prompt_logprobs: int | None = _D["prompt_logprobs"]
    grammar: tuple | None = None      # (kind, text): see grammar.py; compiled by the caller

    def __post_init__(self) -> None:
        # Normalise containers first so that the frozen instance is hashable.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop: expected a string or a list of strings, got {type(stop).__name__}")
        object.__setattr__(self, "stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, (list, tuple)):
            ids = tuple(ids)
        else:
            raise ValueError(
                f"stop_token_ids: expected a list of integers, got {type(ids).__name__}"
            )
        object.__setattr__(self, "stop_token_ids", ids)
        lb = self.logit_bias
        if lb is None:
            lb = ()
        elif isinstance(lb, dict):
            lb = tuple(lb.items())
        elif isinstance(lb, (list, tuple)):
            if not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in lb):
                raise ValueError("logit_bias: expected a mapping of token id to bias or a list of (id, bias) pairs")
            lb = tuple(tuple(e) for e in lb)
        else:
            raise ValueError(f"logit_bias: expected a mapping of token id to bias, got {type(lb).__name__}")
        object.__setattr__(self, "logit_bias", lb)
        self.validate()
        # Canonical Python scalar types (numpy scalars would leak into JSON etc.).
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        object.__setattr__(self, "presence_penalty", float(self.presence_penalty))
        object.__setattr__(self, "frequency_penalty", float(self.frequency_penalty))
        object.__setattr__(self, "logit_bias", tuple(sorted((int(i), float(b)) for i, b in dict(lb).items())))
        if self.grammar is not None:
            object.__setattr__(self, "grammar", tuple(self.grammar))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def validate(self) -> None:
        """Raise ``ValueError("<field>: ...")`` for the first invalid field: the sampling fields by
        their type and range in the one table (sampling_fields.py), then stop, stop ids, bias, grammar."""
        for name, f in SAMPLING_FIELDS.items():
            v = getattr(self, name)
            if v is None and f.default is None:
                continue
            if f.type is bool:
                ok = isinstance(v, (bool, np.bool_))
            elif f.type is int:
                ok = _is_int(v)
            else:
                ok = _is_real(v) and math.isfinite(v)
            why = f.problem(v) if ok else None
            if not ok or why:
                kind = {bool: "a boolean", int: "an integer"}.get(f.type, "a finite number")
                raise ValueError(f"{name}: must be {why or kind}, got {v!r}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop: stop strings must be strings, got {type(s).__name__}")
            if s == "":
                raise ValueError("stop: stop strings must not be empty")
        for i in self.stop_token_ids:
            if not _is_int(i) or i < 0:
                raise ValueError(f"stop_token_ids: must be non-negative integers, got {i!r}")
        for i, b in self.logit_bias:
            if not _is_int(i) or i < 0:
                raise ValueError(f"logit_bias: token ids must be non-negative integers, got {i!r}")
            if not _is_real(b) or not math.isfinite(b):
                raise ValueError(f"logit_bias: the bias of token {i} must be a finite number, got {b!r}")
        g = self.grammar
        if g is not None and not (isinstance(g, (tuple, list)) and len(g) == 2 and all(isinstance(x, str) for x in g)):
            raise ValueError(f"grammar: expected a (kind, text) pair of strings, got {g!r:.60}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that 1/T overflows float32: its limit is the argmax."""
        return self.temperature == 0.0 or 1.0 / self.temperature > float(np.finfo(np.float32).max)

    @property
    def argmax_only(self) -> bool:
        """Greedy with no logit bias and no repetition, presence or frequency penalty: the token is the argmax of
        the logits as given."""
        return self.greedy and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0 \
            and self.frequency_penalty == 0.0 and not self.logit_bias


# --------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------

_BLOCK = 1024  # block size of the two-level inverse CDF
_SMALL = 4 * _BLOCK  # below this, a plain cumsum is cheaper
# Probability thresholds tried when looking for the top-p nucleus among the
# high-probability tokens only (at most 1/tau tokens can have prob >= tau);
# 0 means the whole vocabulary.
_NUCLEUS_TAUS = (1.0 / 256, 1.0 / 4096, 1.0 / 65536, 0.0)
_ARGSORT_MAX = 2048  # larger candidate sets are value-sorted instead


def _cumsearch(w: np.ndarray, target: float | None, u: float | None, side: str) -> int:
    """``searchsorted(cumsum(w), t, side)`` clipped to ``len(w) - 1``.

    ``t`` is ``target`` if given, else ``u * sum(w)``.  For long arrays the
    cumulative sum is done in two levels (block sums, then one block), which
    is several times cheaper than ``np.cumsum`` over the whole array.
    Accumulation is in float64.
    """
    n = w.shape[0]
    if n <= _SMALL:
        c = np.cumsum(w, dtype=np.float64)
        t = target if target is not None else u * c[-1]
        return min(int(np.searchsorted(c, t, side)), n - 1)
    nb = n // _BLOCK
    head = w[: nb * _BLOCK].reshape(nb, _BLOCK)
    cb = np.cumsum(head.sum(axis=1, dtype=np.float64))
    tail = w[nb * _BLOCK :]
    if target is not None:
        t = target
    else:
        t = u * (cb[-1] + float(tail.sum(dtype=np.float64)))
    j = int(np.searchsorted(cb, t, side))
    if j >= nb and tail.shape[0] == 0:
        j = nb - 1
    start = j * _BLOCK
    seg = w[start : start + _BLOCK]
    base = float(cb[j - 1]) if j > 0 else 0.0
    c = np.cumsum(seg, dtype=np.float64)
    c += base
    i = min(int(np.searchsorted(c, t, side)), seg.shape[0] - 1)
    return start + i


class Sampler:
    """Draws one token from a row of logits according to ``SamplingParams``.

    Each sampler owns a private ``np.random.Generator`` seeded from
    ``params.seed`` (fresh OS entropy when ``None``): the same seed and the
    same sequence of logits give the same tokens, and the global NumPy RNG
    is never touched.  Create one sampler per request.

    The caller's logits are never modified: when the penalty or temperature
    path needs to rewrite them, they are copied into scratch buffers owned by
    the sampler (allocated once, so a sampler is not safe to share between
    threads).  Greedy decoding without repetition penalty is a bare
    ``argmax`` on the caller's array (no copy).
    """

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size: must be a positive integer, got {vocab_size!r}")
        self.params = params
        self.vocab_size = int(vocab_size)
        self.rng = np.random.default_rng(params.seed)
        self._greedy = params.greedy
        # a penalty below float32's range would become 0 (a division by zero): clamp it there
        self._penalty = max(params.repetition_penalty, float(np.finfo(np.float32).tiny))
        k = params.top_k
        self._top_k = k if 0 < k < self.vocab_size else 0
        self._top_p = params.top_p
        self._min_p = params.min_p
        self._inv_t = 0.0 if self._greedy else 1.0 / params.temperature
        bad = [i for i, _ in params.logit_bias if i >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}")
        self._bias_ids = np.array([i for i, _ in params.logit_bias], np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], np.float32)
        self._presence, self._frequency = params.presence_penalty, params.frequency_penalty
        self._counts: dict = {}          # token id -> times this sampler returned it (presence/frequency)
        # Scratch buffers, allocated lazily (greedy without penalty needs none).
        self._buf: np.ndarray | None = None  # penalised logits
        self._w: np.ndarray | None = None  # unnormalised probabilities

    # -- helpers ---------------------------------------------------------

    def _scratch(self) -> np.ndarray:
        if self._buf is None:
            self._buf = np.empty(self.vocab_size, dtype=np.float32)
        return self._buf

    def _weights(self) -> np.ndarray:
        if self._w is None:
            self._w = np.empty(self.vocab_size, dtype=np.float32)
        return self._w

    def apply_repetition_penalty(self, x: np.ndarray, history) -> None:
        """In place on ``x``: HF ``RepetitionPenaltyLogitsProcessor``.

        Every distinct id in ``history`` gets ``x*p`` if ``x < 0`` else ``x/p``
        (duplicates are harmless: gather-then-scatter writes the same value).
        Ids outside ``[0, vocab_size)`` are ignored.
        """
        h = np.asarray(history)
        if h.size == 0:
            return
        if h.dtype.kind not in "iu":
            h = h.astype(np.int64)
        h = h.reshape(-1)
        if h.min() < 0 or h.max() >= self.vocab_size:
            h = h[(h >= 0) & (h < self.vocab_size)]
        p = np.float32(self._penalty)
        vals = x[h]
        with np.errstate(over="ignore"):         # a tiny penalty may push a logit to +inf: then it wins
            x[h] = np.where(vals < 0, vals * p, vals / p)

    # -- main entry point ------------------------------------------------

    def sample(self, logits: np.ndarray, history: Sequence[int] | np.ndarray = (), allowed=None) -> int:
        """Return the next token id.

        ``logits``: 1-D array of ``vocab_size`` floats (float32 preferred).
        ``history``: previously seen token ids (prompt + generated), used only
        by the repetition penalty; a NumPy integer array is cheapest.
        ``allowed``: None, or a (vocab_size,) bool mask (a grammar's): the other
        tokens get -inf before anything else.

        Raises ``ValueError`` for a wrong shape, NaN logits, or when every
        logit is ``-inf``.
        """
        x = logits
        if not isinstance(x, np.ndarray) or x.shape != (self.vocab_size,):
            x = np.asarray(x)
            if x.shape != (self.vocab_size,):
                raise ValueError(
                    f"logits: expected shape ({self.vocab_size},), got {x.shape}"
                )
        rep = self._penalty != 1.0 and len(history)
        counted = bool(self._counts) and (self._presence != 0.0 or self._frequency != 0.0)
        if rep or counted or self._bias_ids.size or allowed is not None:
            buf = self._scratch()
            np.copyto(buf, x, casting="unsafe")
            if allowed is not None:
                np.putmask(buf, ~allowed, np.float32(-np.inf))
            if self._bias_ids.size:
                buf[self._bias_ids] += self._bias
            if rep:
                self.apply_repetition_penalty(buf, history)
            if counted:
                ids = np.fromiter(self._counts.keys(), np.int64, len(self._counts))
                c = np.fromiter(self._counts.values(), np.float32, len(self._counts))
                buf[ids] -= c * np.float32(self._frequency) + np.float32(self._presence)
            x = buf
        if self._greedy:
            i = int(np.argmax(x))
            if x[i] != x[i]:
                raise ValueError("logits contain NaN")
        else:
            i = self._sample_temperature(x)
        if self._presence != 0.0 or self._frequency != 0.0:
            self._counts[i] = self._counts.get(i, 0) + 1
        return i

    def _sample_temperature(self, x: np.ndarray) -> int:
        m = float(x.max())  # propagates NaN
        if not math.isfinite(m):
            if math.isnan(m):
                raise ValueError("logits contain NaN")
            if m > 0:  # +inf: degenerate distribution on the first +inf
                return int(np.argmax(x))
            raise ValueError("logits are all -inf")
        inv_t = self._inv_t
        top_p = self._top_p
        min_p = self._min_p

        if self._top_k:
            # HF TopK: keep every logit >= the k-th largest (ties kept).
            v = self.vocab_size
            kth = np.partition(x, v - self._top_k)[v - self._top_k]
            cand = np.flatnonzero(x >= kth)
            w = np.exp((x[cand].astype(np.float64) - m) * inv_t)
            if top_p < 1.0:
                order = np.argsort(-w, kind="stable")
                cand, w = cand[order], w[order]
                n = _cumsearch(w, top_p * float(w.sum()), None, "left") + 1
                cand, w = cand[:n], w[:n]
        elif top_p < 1.0:
            cand, w = self._nucleus(x, m, inv_t, top_p)
        elif min_p > 0.0:
            # Only min-p: prefilter in logit space (p_i/p_max = exp((x_i-m)/T)),
            # with a little slack; the exact test is done on the weights below.
            thr = m + math.log(min_p) / inv_t - 1e-3 * abs(m) - 1e-3
            cand = np.flatnonzero(x >= thr)
            w = np.exp((x[cand] - np.float32(m)) * np.float32(inv_t))
        else:
            # Plain temperature sampling over the whole vocabulary.
            w = self._weights()
            np.subtract(x, np.float32(m), out=w)
            np.multiply(w, np.float32(inv_t), out=w)
            np.exp(w, out=w)
            return self._draw(w, None)

        if min_p > 0.0:
            # The max weight is exp(0) == 1 (top-k/top-p always keep the max),
            # so "p < min_p * p_max" is "w < min_p".
            keep = w >= min_p
            cand, w = cand[keep], w[keep]
        return self._draw(w, cand)

    def _nucleus(self, x: np.ndarray, m: float, inv_t: float, top_p: float):
        """Top-p without top-k: returns (candidate ids, weights) of the nucleus.

        The nucleus is searched among the tokens with probability >= tau for
        decreasing tau (at most 1/tau of them), so a peaked distribution never
        sorts more than a few hundred entries; tau = 0 is the whole vocabulary.
        Small candidate sets are argsorted; big ones are value-sorted to find
        the cut value, then ids are taken by comparison.  Ties at the cut are
        broken towards lower ids either way.
        """
        w = self._weights()
        np.subtract(x, np.float32(m), out=w)
        np.multiply(w, np.float32(inv_t), out=w)
        np.exp(w, out=w)
        z = float(w.sum(dtype=np.float64))
        target = top_p * z
        for tau in _NUCLEUS_TAUS:
            if tau:
                cand = np.flatnonzero(w >= np.float32(tau * z))
                wc = w[cand]
                if float(wc.sum(dtype=np.float64)) < target:
                    continue
            else:
                cand, wc = None, w
            if wc.shape[0] <= _ARGSORT_MAX:
                order = np.argsort(-wc, kind="stable")
                wc = wc[order].astype(np.float64)
                n = _cumsearch(wc, target, None, "left") + 1
                ids = order[:n] if cand is None else cand[order[:n]]
                return ids, wc[:n]
            vals = np.sort(wc)[::-1]
            n = _cumsearch(vals, target, None, "left") + 1
            cut = vals[n - 1]
            above = np.flatnonzero(wc > cut)
            ties = np.flatnonzero(wc == cut)[: n - above.shape[0]]
            pos = np.concatenate([above, ties])
            ids = pos if cand is None else cand[pos]
            return ids, wc[pos].astype(np.float64)
        raise AssertionError("unreachable")  # tau == 0 always returns

    def _draw(self, w: np.ndarray, cand: np.ndarray | None) -> int:
        """Draw index ``i`` with probability ``w[i] / sum(w)``; map via ``cand``."""
        if w.shape[0] == 1:
            return int(cand[0]) if cand is not None else 0
        u = float(self.rng.random())
        i = _cumsearch(w, None, u, "right")
        if not w[i] > 0:  # rounding at a block edge landed on a zero weight
            nz = np.flatnonzero(w > 0)
            if nz.shape[0] == 0:
                i = int(np.argmax(w))
            else:
                i = int(nz[min(int(np.searchsorted(nz, i)), nz.shape[0] - 1)])
        return int(cand[i]) if cand is not None else int(i)


def token_logprobs(logits: np.ndarray, token: int, k: int):
    """(log p(token), top-k ids, their log-probabilities) of one row of raw logits: a log-softmax in
    float64, the alternatives by decreasing probability (ties: lower id first). k may be 0."""
    x = np.asarray(logits)
    m = float(x.max())
    lse = m + math.log(float(np.exp(x.astype(np.float64) - m).sum()))
    if k <= 0:
        return float(x[token]) - lse, np.zeros(0, np.int64), np.zeros(0, np.float64)
    k = min(k, x.shape[0])
    cand = np.argpartition(-x, k - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
    order = np.lexsort((cand, -x[cand]))
    ids = cand[order]
    return float(x[token]) - lse, ids.astype(np.int64), x[ids].astype(np.float64) - lse


# --------------------------------------------------------------------------
# Stop conditions
# --------------------------------------------------------------------------


class StopChecker:
    """Stop strings, stop token ids and EOS for one streaming request.

    Call :meth:`push` with every generated token id and the text piece the
    incremental decoder produced for it; it returns ``(emit_text, finished,
    reason)``:

    * ``emit_text`` -- text that is safe to send to the client now.  Text that
      could still be the beginning of a stop string is held back until the
      following pieces settle it; when a stop string matches, the output ends
      right before it (the stop string itself is excluded, like OpenAI).
    * ``finished`` -- True once a stop string, a stop token or (unless
      ``ignore_eos``) an EOS token was seen.
    * ``reason`` -- ``"stop"`` when finished, else ``None``.  (``"length"`` is
      the caller's business: when it runs out of ``max_tokens`` it calls
      :meth:`flush` to get the held-back text.)

    A stop/EOS token's own text is not emitted, but any held-back text before
    it is (it did not turn into a stop string).  ``token_id`` may be ``None``
    to feed text that belongs to no token (e.g. the incremental decoder's
    final flush).  After ``finished``, further pushes are ignored.
    :attr:`matched` tells which stop string or token id ended generation.
    """

    def __init__(
        self,
        stop_strings: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        *,
        ignore_eos: bool = False,
    ) -> None:
        self.stop_strings: tuple[str, ...] = tuple(stop_strings)
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError("stop: stop strings must be non-empty strings")
        ids = set(int(i) for i in stop_token_ids)
        if not ignore_eos:
            ids.update(int(i) for i in eos_token_ids)
        self.stop_ids = frozenset(ids)
        self._max_hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._pending = ""
        self.finished = False
        self.finish_reason: str | None = None
        self.matched: str | int | None = None

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> "StopChecker":
        return cls(params.stop, params.stop_token_ids, eos_token_ids, ignore_eos=params.ignore_eos)

    def _finish(self, matched: str | int) -> None:
        self.finished = True
        self.finish_reason = "stop"
        self.matched = matched

    def push(self, token_id: int | None, text_piece: str) -> tuple[str, bool, str | None]:
        if self.finished:
            return "", True, self.finish_reason
        if token_id is not None and token_id in self.stop_ids:
            out, self._pending = self._pending, ""
            self._finish(int(token_id))
            return out, True, "stop"
        if not self.stop_strings:
            return text_piece, False, None
        buf = self._pending + text_piece
        if not buf:
            return "", False, None
        # Earliest full match.  No match can start in already emitted text:
        # that text was emitted only because no stop string could start there.
        best = -1
        best_s = None
        for s in self.stop_strings:
            j = buf.find(s)
            if j != -1 and (best == -1 or j < best):
                best, best_s = j, s
        if best != -1:
            self._pending = ""
            self._finish(best_s)
            return buf[:best], True, "stop"
        # Hold back the longest suffix that is a proper prefix of a stop string.
        hold = 0
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                hold = k
                break
        if hold:
            self._pending = buf[-hold:]
            return buf[:-hold], False, None
        self._pending = ""
        return buf, False, None

    def flush(self) -> str:
        """Release held-back text (generation ended for another reason)."""
        out, self._pending = self._pending, ""
        return out

    @property
    def pending(self) -> str:
        """Text currently held back."""
        return self._pending

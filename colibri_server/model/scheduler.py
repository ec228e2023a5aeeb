"""Which rows run in this step: continuous batching over a paged KV pool (vLLM's v1 scheduler, small).

Every step takes, under a token budget (max_batch_tokens), the next token of every decoding
sequence first (their inter-token latency stays one step), then prefill chunks: the rest of
prompts already started, then new prompts admitted while there are slots (max_seqs) and the
pool can hold the whole prompt. A sequence joins at the next step after it arrives and leaves
the step it finishes. A prompt longer than the budget enters in chunks over several steps.

When a decoding sequence needs a block and the pool has none, the youngest running sequence is
preempted: its blocks go back to the pool and it waits at the head of the queue, to be recomputed
from its tokens (prompt and generated so far) when it is admitted again; its registered prefix
blocks may still be cached then. A request that could never fit is refused when it is added; a
request of n completions whose siblings' blocks could never all be held at once runs them in turns
(a sibling with no block for its copy waits and recomputes its prompt).

Owns: the waiting queue, the running set, the choice of rows, admission and preemption.
Never: runs the model, samples, or talks to a socket (serving.py and the worker do).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kv import KVPool, chain_hash


@dataclass(eq=False)
class SeqState:
    """One request inside the worker: its tokens, how many are in the KV pool, and its blocks."""
    rid: object
    tokens: list                      # prompt, then every sampled token
    max_positions: int                # prompt + max_tokens: the blocks it may ever need
    arrival: int
    seq: object = None                # the sampling state (engine.Sequence)
    computed: int = 0                 # tokens whose keys and values are in the pool
    blocks: list = field(default_factory=list)
    registered: int = 0               # full blocks entered in the prefix table
    parent: int = 0                   # chain hash of the last registered block
    matched: bool = False             # the prefix table was consulted (first admission)
    preemptions: int = 0
    choice: int = 0                   # which of the request's n completions
    width: int = 1                    # slots it holds: n until its siblings are forked from it, then 1
    reuse: bool = True                # may start from cached prefix blocks (not when its prompt is scored)
    cacheable: bool = True            # its full blocks may be registered (not when its prompt is embeddings)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed


@dataclass
class Segment:
    """Rows start..start+n-1 of one sequence in this step; `sample` when they reach its last token."""
    state: SeqState
    start: int
    n: int

    @property
    def sample(self) -> bool:
        return self.start + self.n == len(self.state.tokens)


class Scheduler:
    def __init__(self, pool: KVPool, max_seqs: int, max_batch_tokens: int, prefix_cache: bool = True):
        if max_seqs < 1 or max_batch_tokens < 1:
            raise ValueError("max_seqs and max_batch_tokens must be >= 1")
        self.pool, self.max_seqs, self.max_batch_tokens = pool, max_seqs, max(max_batch_tokens, max_seqs)
        self.prefix_cache = prefix_cache
        self.waiting: list = []           # SeqState, admission order (preempted ones first)
        self.running: list = []           # SeqState, oldest first
        self.preemptions = 0
        self._arrivals = 0

    # -- requests ---------------------------------------------------------------------
    def add(self, rid, tokens, max_positions: int) -> SeqState:
        """Queue a request. Raises ValueError when its blocks could never fit in the pool."""
        need = self.pool.blocks_for(max_positions)
        if need > self.pool.num_blocks:
            raise ValueError(f"{max_positions} positions need {need} KV blocks of {self.pool.block_size} but the "
                             f"worker's pool has {self.pool.num_blocks} (kv_cache_memory)")
        self._arrivals += 1
        s = SeqState(rid, list(tokens), max_positions, self._arrivals)
        self.waiting.append(s)
        return s

    def finish(self, s: SeqState) -> None:
        """The sequence is done (or cancelled): its blocks go back to the pool, its prefix stays cached."""
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.pool.release(s.blocks)
        s.blocks = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> list:
        """The segments of the next step (possibly empty when nothing can run)."""
        budget, plan = self.max_batch_tokens, []
        for s in list(self.running):                                  # decoding first, then chunks
            if s not in self.running:
                continue                                              # preempted by an older one
            n = min(s.pending, budget) if s.pending > 1 else s.pending
            if n <= 0:
                continue
            if not self._grow(s, s.computed + n):
                continue                                              # s itself was preempted
            plan.append(Segment(s, s.computed, n))
            budget -= n
            if budget == 0:
                break
        while self.waiting and budget > 0 and self.occupied() + self.waiting[0].width <= self.max_seqs:
            s = self.waiting[0]
            if not s.matched and self.prefix_cache and s.reuse:
                self._match(s)
            if self.blocks_to_start(s) - len(s.blocks) > self.pool.available():
                self._unmatch(s)         # a waiting sequence holds no block: running ones may need them all
                break                    # admission: the whole prompt fits (and its siblings' last blocks)
            self.waiting.pop(0)
            self._insert_running(s)
            n = min(s.pending, budget)
            self._grow(s, s.computed + n)
            plan.append(Segment(s, s.computed, n))
            budget -= n
        return plan

    def blocks_to_start(self, s: SeqState) -> int:
        """Blocks s is admitted with: its prompt's, and a last block for each sibling it forks when
        the pool could ever hold them all at once; otherwise the siblings that find no block for
        their copy wait and recompute (fork): the request runs in turns instead of never."""
        prompt = self.pool.blocks_for(len(s.tokens))
        return prompt + s.width - 1 if prompt + s.width - 1 <= self.pool.num_blocks else prompt

    def stuck(self):
        """After a schedule() that planned nothing: the waiting head, when nothing runs. With every
        block free or evictable and every slot free it was still not admitted, so it never will be
        (None when something runs: its blocks come back)."""
        return self.waiting[0] if self.waiting and not self.running else None

    def occupied(self) -> int:
        """Slots held by running sequences (a request of n completions holds n from its admission)."""
        return sum(s.width for s in self.running)

    def fork(self, s: SeqState, choice: int, seq) -> SeqState:
        """A sibling of s (whose prompt is computed and nothing else): it shares s's full blocks and
        gets a copy of its last, partial one. When the pool has no block for that copy, the sibling
        waits at the head of the queue and recomputes its prompt instead (from cached prefix blocks)."""
        c = SeqState(s.rid, list(s.tokens), s.max_positions, s.arrival, seq, choice=choice, reuse=s.reuse,
                     cacheable=s.cacheable)
        BS, P = self.pool.block_size, s.computed
        full = P // BS
        if P % BS and not self.pool.available():
            c.preemptions += 1
            self.waiting.insert(0, c)
            return c
        for b in s.blocks[:full]:
            self.pool.refs[b] += 1
        c.blocks = list(s.blocks[:full])
        if P % BS:
            b = self.pool.allocate()
            self.pool.copy_block(s.blocks[full], b)
            c.blocks.append(b)
        c.computed, c.registered, c.parent, c.matched = P, s.registered, s.parent, True   # registered <= full
        self.running.insert(self.running.index(s) + choice, c)
        return c

    def _match(self, s: SeqState) -> None:
        s.matched = True
        blocks, key = self.pool.match(s.tokens, len(s.tokens) - 1)  # at least one token left to compute
        if blocks:
            s.blocks, s.registered, s.parent = blocks, len(blocks), key
            s.computed = len(blocks) * self.pool.block_size

    def _unmatch(self, s: SeqState) -> None:
        """Give back the prefix blocks s took when it was matched (it stays waiting; matched again later)."""
        if s.blocks:
            self.pool.unmatch(s.blocks, len(s.tokens) - 1)
            s.blocks, s.computed, s.registered, s.parent, s.matched = [], 0, 0, 0, False

    def _insert_running(self, s: SeqState) -> None:
        i = len(self.running)
        while i > 0 and (self.running[i - 1].arrival, self.running[i - 1].choice) > (s.arrival, s.choice):
            i -= 1
        self.running.insert(i, s)

    def _grow(self, s: SeqState, positions: int) -> bool:
        """Give s blocks for `positions`, preempting the youngest running sequences while the pool
        is dry; False when s itself was the youngest and got preempted."""
        need = self.pool.blocks_for(positions) - len(s.blocks)
        while need > self.pool.available():
            victim = self.running[-1]
            self.preempt(victim)
            if victim is s:
                return False
        for _ in range(max(0, need)):
            s.blocks.append(self.pool.allocate())
        return True

    def preempt(self, s: SeqState) -> None:
        """Free s's blocks; it waits at the head of the queue to be recomputed from its tokens."""
        self.running.remove(s)
        self.pool.release(s.blocks)
        s.blocks, s.computed, s.registered, s.parent, s.matched = [], 0, 0, 0, False
        s.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, s)

    # -- after the forward ----------------------------------------------------------------
    def advance(self, seg: Segment) -> None:
        """The segment's rows are in the pool: count them and register the blocks they filled."""
        s = seg.state
        s.computed = seg.start + seg.n
        BS = self.pool.block_size
        while self.prefix_cache and s.cacheable and (s.registered + 1) * BS <= s.computed:
            i = s.registered
            blk = tuple(s.tokens[i * BS:(i + 1) * BS])
            s.parent = chain_hash(s.parent, blk)
            self.pool.register(s.blocks[i], s.parent, blk)
            s.registered += 1

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "preemptions": self.preemptions}

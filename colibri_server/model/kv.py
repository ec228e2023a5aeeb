"""The paged KV cache of a worker: one pool of fixed-size blocks, a block table per sequence,
and the prefix cache that lets a later sequence reuse the blocks of a prompt it starts with.

Legend: L layers, NB blocks, Hkv kv heads, BS positions per block, hd head dim.

The pool is two arrays (L, NB, Hkv, BS, hd), f32 or f16 (uint16 bits), mapped lazily (latent attention:
one, (L, NB, 1, BS, kv_lora_rank + rotary dims), that is both: mla.py): a block
costs memory once a sequence has written to it, so memory follows the tokens in use, not
slots x context. Free blocks are handed out last-freed first, which keeps the touched set small.

Prefix reuse (vLLM's automatic prefix caching, by block): a block that holds BS known tokens is
registered under a hash of those tokens and of every token before them (a chain), so equal hashes
mean equal prefixes; the tokens themselves are kept and compared on a hit. A block whose last
user leaves stays in the pool as cached (LRU) until a new allocation needs it. Blocks are
reference-counted: a prefix block can serve several running sequences at once (they only read it).

Owns: block allocation, reference counts, the prefix table, the counters shown by `status`.
Never: runs a kernel, decides which sequence runs or is preempted (scheduler.py does).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .config import ModelConfig

KV_DTYPES = {"f32": np.float32, "f16": np.uint16}
BLOCK_SIZE = 16


def block_bytes(cfg: ModelConfig, block_size: int = BLOCK_SIZE, kv_dtype: str = "f16") -> int:
    """Bytes of one block: keys and values of block_size positions in every layer (latent attention:
    the one latent row of each position)."""
    arrays = 1 if cfg.mla else 2
    return arrays * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.cache_dim * \
        np.dtype(KV_DTYPES[kv_dtype]).itemsize


def chain_hash(parent: int, tokens: tuple) -> int:
    """The prefix key of a full block: its tokens and (through parent) every token before them."""
    return hash((parent, tokens))


def first_block_key(tokens, block_size: int = BLOCK_SIZE) -> int | None:
    """The chain hash of a prompt's first block when a later sequence could take that block from the
    prefix cache (the router's affinity key), else None. The scheduler matches at most
    tokens[:len - 1] (one token is always left to compute), so a prompt of one block or less never
    reuses its first block and has no key."""
    if len(tokens) - 1 < block_size:
        return None
    return chain_hash(0, tuple(tokens[:block_size]))


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE, kv_dtype: str = "f16"):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} must be one of {', '.join(KV_DTYPES)}")
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one position")
        self.cfg, self.block_size, self.kv_dtype = cfg, block_size, kv_dtype
        self.num_blocks = num_blocks
        from .kernels import lazy_zeros  # here, not at the top: the router imports first_block_key, no kernel
        shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.cache_dim)   # (L,NB,Hkv,BS,hd)
        self.k = lazy_zeros(shape, KV_DTYPES[kv_dtype])
        self.v = self.k if cfg.mla else lazy_zeros(shape, KV_DTYPES[kv_dtype])
        self.refs = np.zeros(num_blocks, np.int32)
        self._free = list(range(num_blocks - 1, -1, -1))       # a stack: block 0 is handed out first
        self._cached = OrderedDict()                            # block -> None, refs == 0, LRU first
        self._key = {}                                          # block -> its chain hash (registered blocks)
        self._tokens = {}                                       # block -> its tokens (checked on a hit)
        self._by_key = {}                                       # chain hash -> block
        self.hits = 0                                           # prefix blocks reused
        self.hit_tokens = 0
        self.query_tokens = 0                                   # prompt tokens looked up (match)

    # -- counts -----------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.cfg, self.block_size, self.kv_dtype)

    def available(self) -> int:
        """Blocks an allocation can take now: the free ones and the cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    def used(self) -> int:
        return self.num_blocks - self.available()

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def stats(self) -> dict:
        return {"kv_blocks": self.num_blocks, "kv_blocks_used": self.used(), "kv_blocks_free": len(self._free),
                "kv_blocks_cached": len(self._cached), "kv_block_size": self.block_size, "kv_dtype": self.kv_dtype,
                "kv_pool_bytes": self.num_blocks * self.bytes_per_block, "prefix_hits": self.hits,
                "prefix_hit_tokens": self.hit_tokens, "prefix_query_tokens": self.query_tokens}

    # -- allocation -------------------------------------------------------------------
    def allocate(self) -> int:
        """One block for a sequence to write (refs 1); evicts the least recently used cached block
        when none is free. Raises MemoryError when every block is in use (the scheduler prevents it)."""
        if self._free:
            b = self._free.pop()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)
            self._forget(b)
        else:
            raise MemoryError("the KV pool has no free block")
        self.refs[b] = 1
        return b

    def release(self, blocks) -> None:
        """A sequence lets go of its blocks; registered ones stay cached for a later prefix hit."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._key:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def copy_block(self, src: int, dst: int) -> None:
        """dst gets src's keys and values in every layer (a sibling's own copy of a partial block)."""
        self.k[:, dst] = self.k[:, src]
        if self.v is not self.k:
            self.v[:, dst] = self.v[:, src]

    def _forget(self, b: int) -> None:
        key = self._key.pop(b, None)
        self._tokens.pop(b, None)
        if key is not None and self._by_key.get(key) == b:
            del self._by_key[key]

    # -- prefix cache -----------------------------------------------------------------
    def register(self, block: int, key: int, tokens: tuple) -> None:
        """Block `block` now holds the full block `tokens` whose chain hash is `key`."""
        if key in self._by_key or block in self._key:
            return                    # an equal prefix is registered already: keep the first
        self._key[block], self._tokens[block], self._by_key[key] = key, tokens, block

    def match(self, tokens, limit: int) -> tuple:
        """The blocks holding the longest registered prefix of tokens[:limit] in whole blocks, each
        taken (refs + 1) for the caller, and the chain hash of the last one: ([], 0) when the first
        block is not cached."""
        BS, out, parent = self.block_size, [], 0
        for i in range(limit // BS):
            blk = tuple(tokens[i * BS:(i + 1) * BS])
            key = chain_hash(parent, blk)
            b = self._by_key.get(key)
            if b is None or self._tokens.get(b) != blk:
                break
            if self.refs[b] == 0:
                self._cached.pop(b, None)
            self.refs[b] += 1
            out.append(b)
            parent = key
        self.hits += len(out)
        self.hit_tokens += len(out) * BS
        self.query_tokens += limit
        return out, parent

    def unmatch(self, blocks, limit: int = 0) -> None:
        """Undo a match(tokens, limit) whose sequence could not start after all (neither a hit nor a query:
        it is matched again when it starts)."""
        self.release(blocks)
        self.hits -= len(blocks)
        self.hit_tokens -= len(blocks) * self.block_size
        self.query_tokens -= limit

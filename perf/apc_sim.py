"""vLLM's automatic prefix caching (APC), simulated exactly at block level: the reference hit rate
a block-level prefix cache should reach on a trace.

    from apc_sim import simulate
    r = simulate(prompts, capacity=2048, block=16, concurrency=8, generated=[8] * len(prompts))
    r["hit_tokens"] / r["prompt_tokens"]

The model is vLLM v1's KV cache manager: a pool of ``capacity`` blocks of ``block`` tokens; a
full block is cached under the hash of its parent's hash and its token ids; a request reuses the
longest run of cached blocks from its start (at most (L - 1) // block blocks: its last prompt
token is always computed); its other blocks are allocated fresh, evicting the least recently
used cached blocks that no running request holds (a finished request's blocks are freed last
block first, so a prefix's tail goes before its head); its full blocks -- of the prompt and of
the ``generated`` tokens -- are cached.  Requests run ``concurrency`` at a time in trace
order: request i starts when request i - concurrency ends, and its blocks are cached as it
starts (a request running beside one that computes the same prefix hits it: an upper bound
on what vLLM's step-by-step caching gives).  When running requests hold every block, the
pool is overcommitted (vLLM would preempt one), counted in ``overcommitted``.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Optional, Sequence


def chain(tokens: Sequence[int], block: int) -> list[bytes]:
    """The hashes of the full blocks of ``tokens``, each chained to its parent's."""
    out, prev = [], b""
    for i in range(len(tokens) // block):
        prev = hashlib.blake2b(prev + repr(list(tokens[i * block:(i + 1) * block])).encode(),
                               digest_size=16).digest()
        out.append(prev)
    return out


class APC:
    """The pool and its cache, kept across traces (`run` them in the order they were served)."""

    def __init__(self, capacity: int, block: int, concurrency: int = 1):
        self.capacity, self.block, self.concurrency = capacity, block, concurrency
        self.cached: "OrderedDict[bytes, None]" = OrderedDict()   # hashed blocks, least recently used first
        self.refs: dict[bytes, int] = {}                          # running requests holding each hashed block
        self.running: deque = deque()                             # per running request: (its hashes, partial blocks)
        self.loose = 0                                            # blocks of running requests not hashed
        self.overcommitted = 0

    def run(self, prompts: Sequence[Sequence[int]], generated: Optional[Sequence[int]] = None) -> dict:
        """Serve ``prompts`` (each with ``generated[i]`` answer tokens); their hit and prompt tokens."""
        hit_tokens = prompt_tokens = 0
        for i, p in enumerate(prompts):
            hit_tokens += self._one(p, generated[i] if generated is not None else 0) * self.block
            prompt_tokens += len(p)
        return {"hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
                "hit_rate": hit_tokens / max(1, prompt_tokens), "overcommitted": self.overcommitted}

    def drain(self) -> None:
        """Every running request ends (a pause in the trace)."""
        while self.running:
            self._end()

    def _one(self, p: Sequence[int], gen: int) -> int:
        B, cached, refs = self.block, self.cached, self.refs
        if len(self.running) == self.concurrency:
            self._end()
        L = len(p)
        keys = chain(p, B)
        hit = 0
        for k in keys[:(L - 1) // B]:
            if k not in cached:
                break
            hit += 1
        full = chain(list(p) + [-1] * gen, B) if gen else keys    # generated tokens: any ids
        need = -(-(L + gen) // B)
        while len(cached) + self.loose + need - hit > self.capacity:
            victim = next((h for h in cached if h not in refs), None)
            if victim is None:
                self.overcommitted += 1
                break
            del cached[victim]
        mine = full[:need]
        for h in mine:
            cached[h] = None
            cached.move_to_end(h)
            refs[h] = refs.get(h, 0) + 1
        partial = need - len(mine)
        self.loose += partial
        self.running.append((mine, partial))
        return hit

    def _end(self) -> None:
        hashes, partial = self.running.popleft()
        self.loose -= partial
        for h in reversed(hashes):                                # freed tail first: evicted before the head
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
            self.cached.move_to_end(h)


def simulate(prompts: Sequence[Sequence[int]], capacity: int, block: int, concurrency: int = 1,
             generated: Optional[Sequence[int]] = None) -> dict:
    """Hit and prompt tokens of the trace ``prompts`` under APC from an empty pool (see the
    module docstring)."""
    return APC(capacity, block, concurrency).run(prompts, generated)

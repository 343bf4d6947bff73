"""Which kernel serves a request: where its KV is, else the least loaded.

With several kernels behind one gateway (``symphony-gateway --kernel A
--kernel B``), each serving run or program goes to one of them, as SGLang's
router sends a request where its prefix is cached:

1. **pinned**: a continuation (``previous_response_id``) goes to the kernel
   that served the response it continues, and a program naming KV files to
   the kernel holding them; a pin on a kernel out of rotation is an error
   for the caller to explain (`PinnedKernelDown`), never a silent move;
2. **affinity**: a request whose prompt begins like one routed before goes
   where that one went, unless that kernel has more than ``slack`` requests
   in flight beyond the least loaded one (then 3.);
3. **least loaded**: the live kernel with the fewest requests in flight
   (the gateway's own count), ties taken in turn.

**Affinity keys** follow the shape of a chat (the serving program's prefix
cache, symphony.lip.prefixcache, reuses every full block of a prefix it has
seen, so a kernel that saw the leading messages holds their KV): a chat
request's keys are the chained BLAKE2b digests of its
leading messages (the system prompt, then each message after it), salted by
the prefix-cache directory (a user's own, or the shared one: caches that are
not shared do not attract each other) and the tools offered (the chat
template puts them before the messages).  A conversation's next turn
repeats the last prompt and the answer, so after each answer the gateway
also remembers the key of prompt + answer.  A text prompt is cut into
blocks of `TEXT_BLOCK` characters (`TOKEN_BLOCK` tokens for token ids).  A
request without prefix caching has no keys.

**Bounds.** The table keeps at most ``capacity`` keys, least recently used
dropped first (`collections.OrderedDict`: a lookup or an update moves a key
to the end, O(1)); a request adds at most `MAX_KEYS` keys.  A kernel taken
out of rotation loses its keys (one pass over the table: kernels die
rarely; the hot path never scans).  A request that follows its key to a
kernel with at most ``slack`` in flight costs O(1); one that does not scans
the kernels for the least loaded (O(N): at 1,000 kernels the largest cost of
routing, perf/sim_routing.py --scale).  Pure bookkeeping, no I/O: kernels.py
does the talking.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable, Optional

import orjson

TEXT_BLOCK = 1024          # characters of a text prompt per affinity key
TOKEN_BLOCK = 256          # token ids of a token prompt per affinity key
MAX_KEYS = 512             # keys a request adds at most (its longest prefixes)
DIGEST = 16                # bytes


class NoKernel(Exception):
    """No kernel is in rotation."""


class PinnedKernelDown(Exception):
    """The kernel a request is pinned to is out of rotation."""

    def __init__(self, kernel: int):
        super().__init__(f"kernel {kernel} is out of rotation")
        self.kernel = kernel


class RoutingTable:
    """Kernels ``0..n-1``: which are live, their requests in flight, and the
    affinity keys (bounded LRU) that say where a prompt's prefix was sent."""

    def __init__(self, n: int, capacity: int = 100_000, slack: int = 32):
        if n < 1 or capacity < 1 or slack < 0:
            raise ValueError("a routing table needs n >= 1, capacity >= 1, slack >= 0")
        self.n, self.capacity, self.slack = n, capacity, slack
        self.live = [True] * n
        self.in_flight = [0] * n
        self.routed = [0] * n                       # requests sent there, ever
        self.keys = [0] * n                         # affinity keys pointing there
        self.affinity: OrderedDict[bytes, int] = OrderedDict()
        self._turn = 0                              # where the next tie starts

    # ------------------------------------------------------------ choosing
    def choose(self, keys: Iterable[bytes] = (), pin: Optional[int] = None,
               exclude: frozenset = frozenset()) -> tuple[int, str]:
        """(kernel, why): ``why`` is "pinned", "affinity" or "least_loaded".
        ``keys``: the request's affinity keys, longest prefix first;
        ``exclude``: kernels not to use this time (one that refused it).
        NoKernel when none is live (and not excluded); PinnedKernelDown when
        ``pin`` is out of rotation."""
        if pin is not None:
            if not self.live[pin]:
                raise PinnedKernelDown(pin)
            return pin, "pinned"
        for key in keys:
            k = self.affinity.get(key)
            if k is None:
                continue
            self.affinity.move_to_end(key)
            # within the slack of the least loaded; with no more than `slack` in flight it must be
            # (no scan of the kernels then: the common case costs O(1) however many there are)
            if k not in exclude and (self.in_flight[k] <= self.slack or
                                     self.in_flight[k] - self.in_flight[self.least_loaded(exclude)] <= self.slack):
                return k, "affinity"
            break                                   # its kernel is busy: balance instead
        least = self.least_loaded(exclude)
        self._turn = (least + 1) % self.n
        return least, "least_loaded"

    def least_loaded(self, exclude: frozenset = frozenset()) -> int:
        """The live kernel with the fewest requests in flight, ties taken in
        turn (NoKernel if none is live)."""
        best = None
        for j in range(self.n):
            k = (self._turn + j) % self.n
            if self.live[k] and k not in exclude and (best is None or self.in_flight[k] < self.in_flight[best]):
                best = k
        if best is None:
            raise NoKernel()
        return best

    # ------------------------------------------------------------ bookkeeping
    def begin(self, k: int) -> None:
        """A request is sent to kernel ``k``."""
        self.in_flight[k] += 1
        self.routed[k] += 1

    def end(self, k: int) -> None:
        """A request on kernel ``k`` has ended (once per `begin`)."""
        self.in_flight[k] -= 1

    def remember(self, keys: Iterable[bytes], k: int) -> None:
        """``keys`` now live on kernel ``k`` (most recently used)."""
        if not self.live[k]:
            return
        for key in keys:
            old = self.affinity.get(key)
            if old != k:
                if old is not None:
                    self.keys[old] -= 1
                self.keys[k] += 1
            self.affinity[key] = k
            self.affinity.move_to_end(key)
        while len(self.affinity) > self.capacity:
            _, old = self.affinity.popitem(last=False)
            self.keys[old] -= 1

    def take_out(self, k: int) -> int:
        """Kernel ``k`` stops answering: out of rotation, its affinity keys
        dropped (their KV went with it).  Returns how many were dropped."""
        self.live[k] = False
        if not self.keys[k]:
            return 0
        gone = [key for key, v in self.affinity.items() if v == k]
        for key in gone:
            del self.affinity[key]
        self.keys[k] = 0
        return len(gone)

    def put_back(self, k: int) -> None:
        """Kernel ``k`` answers again: back in rotation (with no keys yet)."""
        self.live[k] = True


# ---------------------------------------------------------------- affinity keys
def request_keys(req: dict) -> list[bytes]:
    """The affinity keys of a serve-contract request, longest prefix first
    ([] without prefix caching)."""
    cache = req.get("cache")
    if not cache:
        return []
    if req.get("mode") == "chat":
        return _chain(_salt(req, "chat"), [_message(m) for m in req.get("messages") or []])
    return _chain(_salt(req, "text"), _text_blocks(req.get("prompt")))


def answer_keys(req: dict, answer: str, calls: list) -> list[bytes]:
    """The keys of the request's prompt followed by its answer (what a
    conversation's next turn starts with): the one of prompt + answer
    message for chat, the text's for a text prompt; [] where there is none."""
    if not req.get("cache"):
        return []
    if req.get("mode") == "chat":
        said = {"role": "assistant", "content": answer}
        if calls:
            said["tool_calls"] = calls
        return _chain(_salt(req, "chat"), [_message(m) for m in (req.get("messages") or []) + [said]])[:1]
    prompt = req.get("prompt")
    if not isinstance(prompt, str):
        return []
    return _chain(_salt(req, "text"), _text_blocks(prompt + answer))


def _salt(req: dict, mode: str) -> bytes:
    cache = req["cache"]
    what = [mode, cache.get("dir"), sorted(cache.get("trust") or []), req.get("tools") if mode == "chat" else None]
    return hashlib.blake2b(orjson.dumps(what, option=orjson.OPT_SORT_KEYS), digest_size=DIGEST).digest()


def _message(m: dict) -> bytes:
    """A message as the chat template reads it: role, text, tool calls."""
    calls = [[c.get("name"), c.get("arguments")] for c in m.get("tool_calls") or []]
    return orjson.dumps([m.get("role"), m.get("content") or "", m.get("name"), calls, m.get("tool_call_id")])


def _text_blocks(prompt) -> list[bytes]:
    if isinstance(prompt, str):
        return [prompt[i:i + TEXT_BLOCK].encode("utf-8", "surrogatepass") for i in range(0, len(prompt), TEXT_BLOCK)]
    if isinstance(prompt, list):
        return [orjson.dumps(prompt[i:i + TOKEN_BLOCK]) for i in range(0, len(prompt), TOKEN_BLOCK)]
    return []


def _chain(salt: bytes, pieces: list[bytes]) -> list[bytes]:
    """The chained digest after each piece, longest first, at most MAX_KEYS."""
    out, d = [], salt
    for p in pieces:
        d = hashlib.blake2b(d + len(p).to_bytes(8, "little") + p, digest_size=DIGEST).digest()
        out.append(d)
    return out[::-1][:MAX_KEYS]

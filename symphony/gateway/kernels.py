"""The kernels behind the gateway: a `KernelLink` each, their state, and where a program runs.

    kernels = Kernels(["/run/a.sock", "/run/b.sock"], user="local")
    await kernels.connect(60)                  # the first kernel to answer names the model
    s = await kernels.spawn(user, source, args, ..., keys=request_keys(req))
    ...                                        # s.kernel: the Kernel it runs on
    await s.close()                            # it no longer counts as in flight there

Where each program goes is router.py's `RoutingTable` (pinned, KV affinity,
least loaded); this module talks to the kernels and keeps the table true:

    up ------ its socket refuses a connection, or a probe fails -----> down
    up ------ a connection drops mid-stream: probed at once ---------> down (if the probe fails)
    up ------ a probe finds another instance (it restarted) ---------> up, its affinity keys dropped
    down ---- a background probe answers (same model) --------------> up
    down ---- it answers, but serves another model ------------------> wrong_model (kept out, probed on)
    up ------ its stats say it is draining (symphony drain) ---------> draining (kept out; ``on_draining``
                                                                        moves its users' files, moves.py)

A kernel out of rotation loses its affinity keys and is probed (`stats`) in
the background, after 0.5 s, then twice as long after each failure up to
`MAX_BACKOFF_S`, until it answers; it then takes requests again.  A fresh
request never waits for a dead kernel: a spawn the socket refuses is retried
on another live kernel, as is one a kernel refuses with a full admission
queue.  With no kernel in rotation the answer is a 503.  A request pinned to
a kernel (a stored response's continuation) is not moved: the caller says
why with `PinnedKernelDown`.  Before either answer, the kernels it could have
used are probed once more (at most every `REVIVE_EVERY_S`), so that a kernel
back on its socket serves at once, not at its next background probe.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, Optional

from .errors import ApiError
from .kernel import KernelLink, KernelRefused, KernelUnavailable, LipSession
from .router import NoKernel, PinnedKernelDown, RoutingTable

log = logging.getLogger("symphony.gateway")

PROBE_TIMEOUT_S = 5.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
REVIVE_EVERY_S = 0.25


class Kernel:
    """One kernel behind the gateway: its socket, link, state and what it said of itself."""

    def __init__(self, index: int, address: str, credentials=None):
        self.link = KernelLink(address, credentials)
        self.index, self.socket = index, self.link.address      # a Unix path or tls://HOST:PORT
        self.state = "starting"                      # up | down | wrong_model
        self.since = time.time()                     # of the state
        self.error: Optional[str] = None             # why it is out of rotation
        self.model: Optional[str] = None
        self.model_name: Optional[str] = None
        self.context = 2048
        self.kv_tokens_max = 2048                    # the largest kv_tokens hint it accepts
        self.fingerprint = "symphony"
        self.instance: Optional[str] = None          # changes when a kernel restarts on the socket
        self.stats: dict = {}                        # its last `stats` reply
        self.retry: Optional[asyncio.Task] = None    # the background probe, while out of rotation
        self.check: Optional[asyncio.Task] = None    # a probe after a dropped connection
        self.probed = 0.0                            # time.monotonic() of its last probe

    def learn(self, st: dict) -> None:
        """Take in its `stats` reply: model, context, KV pool, instance."""
        self.stats = st
        self.model = st.get("model") or "default"
        self.model_name = st.get("model_name")
        self.context = int(st.get("context") or 2048)
        # a kv_tokens hint above what the device pool can ever hold is refused by the kernel
        pool = int(st.get("kv_pages_total") or 0) * int(st.get("page_size") or 0)
        self.kv_tokens_max = min(self.context, pool) if pool else self.context
        self.fingerprint = f"symphony-{st.get('instance', '0')}"
        self.instance = st.get("instance")

    def __repr__(self) -> str:
        return f"kernel {self.index} ({self.socket})"


class Kernels:
    """The gateway's kernels (see the module docstring)."""

    def __init__(self, paths: list[str], user: str, *, capacity: int = 100_000, slack: int = 32,
                 metrics=None, credentials=None, on_draining: Optional[Callable[[Kernel], None]] = None):
        """``paths``: each kernel's address (a Unix socket, or tls://HOST:PORT reached with
        ``credentials``, ipc/transport.py); ``user``: who probes them; ``on_draining(k)``:
        called (on the event loop) when ``k`` is first seen draining."""
        self.on_draining = on_draining
        self.all = [Kernel(i, p, credentials) for i, p in enumerate(paths)]
        self.user = user                             # who probes (`stats` needs no privilege)
        self.table = RoutingTable(len(paths), capacity, slack)
        self.metrics = metrics
        self.model: Optional[str] = None             # the model every kernel must serve
        self._probes: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self.all)

    def __iter__(self):
        return iter(self.all)

    def __getitem__(self, i: int) -> Kernel:
        return self.all[i]

    @property
    def first(self) -> Kernel:
        """The kernel that named the model (the first to answer)."""
        return next((k for k in self.all if k.model == self.model and k.state == "up"), self.all[0])

    def live(self) -> list[Kernel]:
        return [k for k in self.all if self.table.live[k.index]]

    # ------------------------------------------------------------ probing
    async def probe(self, k: Kernel) -> Optional[dict]:
        """Its `stats` (None if it does not answer); the answer puts it back
        in rotation, silence or another model takes it out."""
        k.probed = time.monotonic()
        st = await self._ask_stats(k)
        if st is None:
            self.lost(k, k.error or "it does not answer")
        else:
            self._answered(k, st)
        return st

    async def _ask_stats(self, k: Kernel) -> Optional[dict]:
        try:
            return await asyncio.wait_for(k.link.request(self.user, {"op": "stats"}), PROBE_TIMEOUT_S)
        except (KernelUnavailable, KernelRefused, asyncio.TimeoutError, OSError) as e:
            k.error = str(e) or type(e).__name__
            return None

    def _answered(self, k: Kernel, st: dict) -> None:
        restarted = k.instance is not None and st.get("instance") != k.instance
        k.learn(st)
        if restarted and self.table.live[k.index]:     # between two probes: its KV is gone, and its keys
            log.warning("%s restarted: its %d affinity keys dropped", k, self.table.take_out(k.index))
            self.table.put_back(k.index)
        if k.model != self.model:
            self._out(k, "wrong_model", f"it serves the model {k.model!r}, the gateway serves {self.model!r}")
        elif st.get("draining"):
            first = k.state != "draining"
            self._out(k, "draining", "it is draining: it starts no new LIPs")
            if first and self.on_draining is not None:
                self.on_draining(k)
        elif k.state != "up":
            if k.state != "starting":
                log.warning("%s answers again: back in rotation", k)
            k.state, k.since, k.error = "up", time.time(), None
            self.table.put_back(k.index)
            self._live_metric(k)

    async def connect(self, wait_s: float = 60.0) -> None:
        """Wait (up to ``wait_s``) until a kernel answers; the first to answer
        names the model.  Kernels that do not answer yet are probed in the
        background and join when they do.  RuntimeError if none answers."""
        deadline = time.monotonic() + wait_s
        while True:
            answers = await asyncio.gather(*(self._ask_stats(k) for k in self.all))
            if any(a is not None for a in answers):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("; ".join(str(k.error) for k in self.all))
            await asyncio.sleep(0.5)
        self.model = next(a for a in answers if a is not None).get("model") or "default"
        for k, st in zip(self.all, answers):
            if st is None:
                self.lost(k, k.error or "it does not answer")
            else:
                self._answered(k, st)

    async def refresh(self) -> list[Optional[dict]]:
        """Probe every kernel at once (for /health and /metrics); their stats."""
        return list(await asyncio.gather(*(self.probe(k) for k in self.all)))

    async def revive(self, ks: list[Kernel]) -> bool:
        """Probe those of ``ks`` out of rotation now (not again within
        `REVIVE_EVERY_S`): a request that would otherwise fail need not wait
        for the background probe.  True if one is back."""
        now = time.monotonic()
        due = [k for k in ks if not self.table.live[k.index] and now - k.probed >= REVIVE_EVERY_S]
        await asyncio.gather(*(self.probe(k) for k in due))
        return any(self.table.live[k.index] for k in due)

    def lost(self, k: Kernel, why: str) -> None:
        """``k`` does not answer: out of rotation, probed in the background."""
        self._out(k, "down", why)

    def suspect(self, k: Kernel, why: str) -> None:
        """A connection to ``k`` dropped: probe it now (out of rotation if it
        does not answer)."""
        if k.state == "up" and (k.check is None or k.check.done()):
            log.info("%s: a connection dropped (%s); probing it", k, why)
            k.check = self._spawn_task(self.probe(k))

    def _out(self, k: Kernel, state: str, why: str) -> None:
        was_live, changed = self.table.live[k.index], k.state != state
        if was_live:
            dropped = self.table.take_out(k.index)
            log.warning("%s is out of rotation: %s (%d affinity keys dropped); probing it in the background",
                        k, why, dropped)
        elif changed:
            log.warning("%s: %s", k, why)
        if changed:
            k.state, k.since = state, time.time()
        k.error = why
        self._live_metric(k)
        if k.retry is None or k.retry.done():
            k.retry = self._spawn_task(self._retry(k))

    async def _retry(self, k: Kernel) -> None:
        delay = FIRST_BACKOFF_S
        while k.state != "up":
            await asyncio.sleep(delay)
            if k.state == "up":
                return
            await self.probe(k)
            delay = min(MAX_BACKOFF_S, delay * 2)

    def _spawn_task(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._probes.add(t)
        t.add_done_callback(self._probes.discard)
        return t

    async def close(self) -> None:
        """Stop the background probes (the gateway is stopping)."""
        for t in list(self._probes):
            t.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)

    def _live_metric(self, k: Kernel) -> None:
        if self.metrics is not None:
            self.metrics.kernel_live.labels(k.socket).set(1 if k.state == "up" else 0)

    # ------------------------------------------------------------ routing
    def unavailable(self) -> ApiError:
        """The 503 of a gateway with no kernel in rotation."""
        why = "; ".join(f"{k.socket}: {k.state} for {time.time() - k.since:.0f} s ({k.error})" for k in self.all)
        return ApiError(503, f"the model server is not available: no kernel answers ({why})",
                        code="kernel_unavailable", retry_after=5)

    async def spawn(self, user: str, source: str, args: list, *, keys: Iterable[bytes] = (),
                    pin: Optional[int] = None, kv_tokens: Optional[Callable[[Kernel], Optional[int]]] = None,
                    **spawn) -> LipSession:
        """Spawn a LIP on the kernel the table chooses (``keys``: the request's
        affinity keys, longest first; ``pin``: the kernel it must run on);
        ``kv_tokens(kernel)``: its admission hint there.  A kernel that does
        not answer is taken out and the next one tried; with none left,
        ApiError 503.  KernelRefused as the kernel says; PinnedKernelDown for
        a pin out of rotation.  The session's ``kernel`` is where it runs."""
        keys, exclude, revived = list(keys), set(), False
        while True:
            try:
                i, why = self.table.choose(keys, pin, frozenset(exclude))
            except (NoKernel, PinnedKernelDown) as e:
                wanted = self.all if pin is None else [self.all[pin]]
                if not revived and await self.revive(wanted):
                    revived = True
                    continue
                if isinstance(e, PinnedKernelDown):
                    raise
                raise self.unavailable() from None
            k = self.all[i]
            self.table.begin(i)
            try:
                s = await k.link.start(user, source, args, kv_tokens=kv_tokens(k) if kv_tokens else None, **spawn)
            except KernelUnavailable as e:
                self.table.end(i)
                self.lost(k, str(e))
                if pin is not None:
                    raise PinnedKernelDown(i) from None
                continue
            except KernelRefused as e:
                self.table.end(i)
                if e.type == "Draining":
                    self.suspect(k, "it is draining")       # its stats will say so: out of rotation
                if e.type in ("QueueFull", "Draining") and pin is None and len(exclude) + 1 < len(self.live()):
                    exclude.add(i)                   # its queue is full, or it drains: another kernel may take it
                    continue
                raise
            except BaseException:
                self.table.end(i)
                raise
            if self.metrics is not None:
                self.metrics.routed.labels(k.socket, why).inc()
            s.kernel = k
            s.on_close = lambda i=i: self.table.end(i)
            s.on_lost = lambda why, k=k: self.suspect(k, why)
            return s

    def remember(self, keys: Iterable[bytes], k: Kernel) -> None:
        self.table.remember(keys, k.index)

    # ------------------------------------------------------------ reporting
    def rows(self) -> list[dict]:
        """Each kernel's state, as /health and /v1/models show it."""
        now = time.time()
        out = []
        for k in self.all:
            row = {"id": k.index, "socket": k.socket, "state": k.state, "since_s": round(now - k.since, 1),
                   "in_flight": self.table.in_flight[k.index], "routed": self.table.routed[k.index],
                   "affinity_keys": self.table.keys[k.index], "model": k.model}
            if k.error:
                row["error"] = k.error
            out.append(row)
        return out

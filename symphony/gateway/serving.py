"""Running the serving program for one OpenAI request.

The gateway does no model work: every OpenAI request becomes one run of a
serving program (by default the stock `userland/serve.py`) spawned for the
key's user, with the key's priority and the gateway's limits, so that
admission, fairness, suspension and KV quotas apply to HTTP traffic as they
do to ``symphony run``.  The program gets the request, normalized, as its one
argument (JSON) and answers with events (`send(dict)`): the contract declared
in `symphony.ipc.serving` (docs/reference/serving.md):

    {"event": "prompt", "prompt_tokens", "cached_tokens"}
    {"event": "text", "index", "text", "logprobs"?}
    {"event": "tool_call", "index", "call", "id"?, "name"?, "arguments"}
    {"event": "done", "index", "finish_reason", "completion_tokens", "stop_sequence"?}
    {"event": "error", "status", "code", "message", "param"}   (then exit 2)

Each request is checked against the contract before it is sent (a violation
is the client's: 400), and each event as it arrives: an event outside the
contract, or out of order (a choice's piece before the prompt event or after
its ``done``, a call's piece out of turn, a choice the request did not ask
for), fails the request with 500 ``program_failed`` and closes the run.

The request's ``stream`` is the client's: for an answer that is not
streamed the program merges each choice's text into few events (the first
piece at once, so the first token is still timed), and the gateway pays
for a handful of frames instead of one per token.

`ServeRun` spawns the program(s) (one per prompt of a batched completion),
merges their events in arrival order (choice indexes offset per prompt),
checks them, and counts usage and latency metrics as they pass (the gaps
between pieces only when streamed: merged pieces are not tokens).  A run's
first event is awaited before the HTTP response starts, so a request the
program refuses still gets its own status, streamed or not.

With several kernels, a run goes where router.py says (a batch's prompts
all to one kernel): a continuation to the kernel of the response it
continues (``pin``), a prompt that begins like one routed before to that
one's kernel, else the least loaded.  Its prompts' affinity keys are
remembered there when it starts, and prompt + answer when it ends.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import orjson

from symphony.ipc import serving as contract

from .errors import ApiError
from .kernel import KernelRefused, KernelUnavailable, LipSession
from .router import PinnedKernelDown, answer_keys, request_keys

log = logging.getLogger("symphony.gateway")

QUEUED_EVENTS = 64          # events read from the kernel ahead of the client, per request

_KERNEL_STATUS = {"QueueFull": 503, "LimitExceeded": 403, "PermissionError": 403, "IdentityError": 403,
                  "ValueError": 400}


def kernel_error(e: Exception) -> ApiError:
    """An ApiError for a kernel that refused a spawn or could not be reached."""
    if isinstance(e, KernelUnavailable):
        return ApiError(503, f"the model server is not available: {e}", code="kernel_unavailable", retry_after=5)
    if isinstance(e, KernelRefused):
        status = _KERNEL_STATUS.get(e.type, 400 if e.code == "EINVAL" else 503)
        return ApiError(status, f"the kernel refused the request: {e}", code=(e.type or "refused").lower(),
                        retry_after=2 if status == 503 else None)
    raise e


@dataclass
class Choice:
    """What one choice has produced so far."""
    text: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    calls: list = field(default_factory=list)        # [{"id", "name", "arguments"}]
    finish_reason: Optional[str] = None
    stop_sequence: Optional[str] = None              # the stop string that ended it
    completion_tokens: int = 0
    last_at: Optional[float] = None


class ServeRun:
    """The serving program's run(s) for one request (see the module docstring)."""

    def __init__(self, gw, route: str, requests: list[dict], n: int, key, priority: str = "normal",
                 pin: Optional[int] = None, pinned_by: Optional[str] = None, follow=None):
        """``pin``: the kernel it must run on, because of ``pinned_by`` (the
        response it continues); ``follow()``: asked once for another pin when that
        kernel turns out to be gone (its files moved: moves.py)."""
        self.gw, self.route, self.requests, self.n, self.key = gw, route, requests, n, key
        self.priority, self.pin, self.pinned_by, self.follow = priority, pin, pinned_by, follow
        self.streamed = all(r.get("stream", True) for r in requests)
        self.kernel = None                           # the kernels.Kernel it runs on, once started
        self.sessions: list[LipSession] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.choices = [Choice() for _ in range(n * len(requests))]
        self.started = time.monotonic()
        self.first_token_at: Optional[float] = None
        # bounded: a client that reads nothing stops the pumps, so the kernel's output
        # credit stops its programs, instead of this queue growing
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUED_EVENTS)
        self._pumps: list[asyncio.Task] = []
        self._pending_prompt = len(requests)
        self._prompted: set = set()                  # the runs whose prompt event came
        self._live = 0
        self._stderr: list[str] = []
        self._closed = False

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def start(self) -> None:
        """Spawn the program for each request; ApiError if the kernel refuses
        or none can take it."""
        source, filename = self.gw.program(self.route)
        kernels, pin = self.gw.kernels, self.pin
        for req in self.requests:                    # the contract's own check, before anything runs
            try:
                contract.build_request(req)
            except contract.ContractError as e:
                raise ApiError(400, f"invalid request: {e}", param=e.param or None) from None
        try:
            for req in self.requests:
                keys = request_keys(req)
                s = await kernels.spawn(
                    self.key.user, source, [orjson.dumps(req).decode()], keys=keys, pin=pin, filename=filename,
                    grants={}, limits={"timeout": self.gw.cfg.request_timeout}, priority=self.priority,
                    kv_tokens=lambda k, req=req: _kv_estimate(req, k.kv_tokens_max))
                self.sessions.append(s)
                self.kernel = s.kernel
                pin = s.kernel.index                 # a batch's other prompts: the same kernel
                kernels.remember(keys, s.kernel)
                self.gw.metrics.lips_started.labels(self.route).inc()
        except PinnedKernelDown as e:
            follow, self.follow = self.follow, None
            moved = await follow() if follow is not None and not self.sessions else None
            if moved is not None and moved != e.kernel:
                self.pin = moved
                return await self.start()
            await self.close()
            raise self._gone(kernels[e.kernel]) from None
        except (KernelRefused, KernelUnavailable) as e:
            await self.close()
            raise kernel_error(e) from None
        except BaseException:
            await self.close()
            raise
        for i, s in enumerate(self.sessions):
            self._pumps.append(asyncio.get_running_loop().create_task(self._pump(i, s)))
        self._live = len(self.sessions)

    def _gone(self, kernel) -> ApiError:
        """The 503 of a run whose kernel is out of rotation."""
        if self.pinned_by:
            return ApiError(503, f"the conversation of previous_response_id {self.pinned_by!r} lives on the "
                                 f"kernel at {kernel.socket}, which is not answering ({kernel.error}); retry "
                                 f"later, or send the conversation as input without previous_response_id to "
                                 f"continue it on another kernel", code="previous_response_unavailable",
                            param="previous_response_id", retry_after=5)
        return ApiError(503, f"the kernel at {kernel.socket} stopped answering while this request started "
                             f"({kernel.error}); retry", code="kernel_unavailable", retry_after=1)

    async def _pump(self, k: int, s: LipSession) -> None:
        async for ev in s.events():
            await self._queue.put((k, ev))
        await self._queue.put((k, None))

    async def events(self) -> AsyncIterator[dict]:
        """The programs' output events, checked, with choice indexes made global;
        the first is always {"event": "prompt"} (summed over the prompts).
        ApiError if a program refuses the request or fails."""
        early = []                                       # a batch's events before its last prompt event
        while self._live:
            k, ev = await self._queue.get()
            if ev is None:
                self._live -= 1
                continue
            out = self._accept(k, ev)
            if out is None:
                continue
            if self._pending_prompt:
                early.append(out)
                continue
            yield out
            while early:
                yield early.pop(0)
        unfinished = [i for i, c in enumerate(self.choices) if c.finish_reason is None]
        if not unfinished:
            self._remember_answers()
            return
        if any((s.exit or {}).get("lost") for s in self.sessions):
            raise ApiError(503, f"the kernel at {self.kernel.socket} stopped answering before choice(s) "
                                f"{unfinished} finished; retry", code="kernel_unavailable", retry_after=1)
        exits = [s.exit or {} for s in self.sessions]
        bad = next((e for e in exits if e.get("status", 0) != 0), exits[0] if exits else {})
        tail = "".join(self._stderr)[-2000:].strip()
        log.warning("serving program failed (user %s, LIP %s): %s (status %s)%s", self.key.user,
                    ",".join(str(s.lip) for s in self.sessions), bad.get("reason"), bad.get("status"),
                    f"; its stderr:\n{tail}" if tail else "")
        raise ApiError(500, f"the serving program ended without finishing choice(s) {unfinished}: "
                            f"{bad.get('reason', 'unknown')} (status {bad.get('status')}); the gateway's "
                            f"log has its error output", code="program_failed")

    def _remember_answers(self) -> None:
        """Prompt + answer of each choice, as the next turn will send them: on this kernel."""
        for k, req in enumerate(self.requests):
            for c in self.choices[k * self.n:(k + 1) * self.n]:
                self.gw.kernels.remember(answer_keys(req, "".join(c.text), c.calls), self.kernel)

    def _accept(self, k: int, ev: dict) -> Optional[dict]:
        kind = ev.get("event")
        if kind == "stderr":
            if sum(map(len, self._stderr)) < 4096:
                self._stderr.append(str(ev.get("data", "")))
            return None
        if kind != "out":
            return None                                  # started, stdout, exit: not the answer
        try:
            d = contract.decode_event(ev.get("data"))
        except contract.ContractError as e:
            raise self._broken(f"an event outside its contract ({e}; param {e.param or '-'})") from None
        if isinstance(d, contract.ErrorEvent):
            raise ApiError(d.status, d.message[:2000], code=d.code, param=d.param)
        if isinstance(d, contract.PromptEvent):
            if k in self._prompted:
                raise self._broken("a second prompt event")
            self._prompted.add(k)
            self.prompt_tokens += d.prompt_tokens
            self.cached_tokens += d.cached_tokens
            self._pending_prompt -= 1
            if self._pending_prompt:
                return None
            m = self.gw.metrics
            m.prompt_tokens.labels(self.route).inc(self.prompt_tokens)
            m.cache_queries.inc(self.prompt_tokens)
            m.cache_hits.inc(self.cached_tokens)
            return {"event": "prompt", "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}
        if k not in self._prompted:
            raise self._broken(f"a {type(d).__name__} before its prompt event")
        if d.index >= self.n:
            raise self._broken(f"an event of choice {d.index}; the request has {self.n}")
        i = d.index + k * self.n
        c = self.choices[i]
        if c.finish_reason is not None:
            raise self._broken(f"an event of choice {d.index} after its done event")
        now = time.monotonic()
        if not isinstance(d, contract.DoneEvent):
            if self.first_token_at is None:
                self.first_token_at = now
                self.gw.metrics.ttft.labels(self.route).observe(now - self.started)
            elif c.last_at is not None and self.streamed:
                self.gw.metrics.itl.labels(self.route).observe(now - c.last_at)
            c.last_at = now
        if isinstance(d, contract.TextEvent):
            lps = ev["data"].get("logprobs") or None        # checked by decode_event
            c.text.append(d.text)
            if lps:
                c.logprobs.extend(lps)
            return {"event": "text", "index": i, "text": d.text, "logprobs": lps}
        if isinstance(d, contract.ToolCallEvent):
            if d.call == len(c.calls):                   # a new call: its first piece names it
                if d.name is None:
                    raise self._broken(f"call {d.call} of choice {d.index} began without a name")
                c.calls.append({"id": d.id or f"call_{secrets.token_hex(12)}", "name": d.name,
                                "arguments": d.arguments})
                return {"event": "tool_call", "index": i, "call": d.call, "start": True, **c.calls[-1],
                        "delta": d.arguments}
            if d.call != len(c.calls) - 1 or d.name is not None or (d.id is not None and d.id != c.calls[-1]["id"]):
                raise self._broken(f"a piece of call {d.call} of choice {d.index} out of order "
                                   f"({len(c.calls)} calls so far)")
            c.calls[-1]["arguments"] += d.arguments
            return {"event": "tool_call", "index": i, "call": d.call, "start": False, "delta": d.arguments}
        c.finish_reason = d.finish_reason
        c.stop_sequence = d.stop_sequence
        c.completion_tokens = d.completion_tokens
        self.gw.metrics.generation_tokens.labels(self.route).inc(c.completion_tokens)
        return {"event": "done", "index": i, "finish_reason": c.finish_reason}

    def _broken(self, what: str) -> ApiError:
        """The 500 of a serving program that broke its contract (a bug in the program)."""
        log.error("serving program (user %s, LIP %s) sent %s", self.key.user,
                  ",".join(str(s.lip) for s in self.sessions), what)
        return ApiError(500, f"the serving program sent {what}; the gateway's log has the details",
                        code="program_failed")

    async def first(self) -> dict:
        """Wait for the first event (the prompt's), so that a refusal is known
        before the HTTP response starts; returns it and keeps the rest."""
        self._events = self.events()
        return await self._events.__anext__()

    def rest(self) -> AsyncIterator[dict]:
        return self._events

    async def close(self) -> None:
        """Stop the program(s): close their connections (the kernel kills a LIP
        still running and reclaims its pages).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._pumps:
            t.cancel()
        for s in self.sessions:
            await s.close()
        self.gw.metrics.e2e.labels(self.route).observe(time.monotonic() - self.started)


EXPECTED_ANSWER = 256        # tokens of an answer that admission counts on (see _kv_estimate)


def _kv_estimate(req: dict, context: int) -> int:
    """KV tokens to tell admission this request is expected to need: its text at ~3
    characters a token plus the answer it will likely write - its limit, at most
    EXPECTED_ANSWER tokens - per choice (forks share the prompt's pages), at most the
    context.  What is expected, not the worst case: reserving each request's whole limit
    (2,048 tokens by default) let 2-3 requests run at once on the default pool while the rest
    queued; an answer that grows past the estimate takes pages as it goes, and when the device
    is short the kernel's memory manager suspends LIPs to the host tier (sched/memory.py), as
    vLLM preempts."""
    if req.get("mode") == "chat":
        prompt = sum(len(m.get("content") or "") for m in req.get("messages", [])) // 3
    elif isinstance(req.get("prompt"), list):
        prompt = len(req["prompt"])
    else:
        prompt = len(req.get("prompt") or "") // 3
    gen = min(req.get("max_tokens") or EXPECTED_ANSWER, EXPECTED_ANSWER)
    return max(1, min(context, prompt + 64 + gen * max(1, req.get("n", 1))))

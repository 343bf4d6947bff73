"""Serve one OpenAI-style request (chat or text completion) as the HTTP gateway asks; prefix caching as a policy.

    symphony run serve '{"mode": "chat", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

This is the program behind every `/v1/chat/completions`, `/v1/completions` and
`/v1/responses` request of `symphony-gateway`.  An administrator may serve a
route with a program of their own: it must keep this contract.

**Input.** `main` gets ONE argument, a JSON object (the gateway has checked
types and ranges; the program checks again and refuses bad input with an
``error`` event, never a traceback).  Unknown fields are refused.

* ``mode``: ``"chat"`` or ``"text"``.
* chat: ``messages``: ``[{"role": "system"|"developer"|"user"|"assistant"|"tool",
  "content": str, "name"?: str, "tool_calls"?: [{"id", "name", "arguments": JSON
  text}], "tool_call_id"?: str}]`` (content flattened to one string; null
  content is ""; ``developer`` is a system message; ``name`` is ignored).
* text: ``prompt``: a string or a list of token ids; ``echo`` (bool): the
  answer's text starts with the prompt (its own first ``text`` event).
* ``max_tokens``: int >= 1, or null (default): up to the end of the context.
  ``temperature`` in [0, 2] (default 1; 0 = greedy), ``top_p`` in (0, 1],
  ``seed``: int or null (choice i uses seed + i), ``stop``: up to 4 non-empty
  strings, ``n``: 1..16 choices, ``logprobs`` (bool), ``top_logprobs``: 0..20
  (needs logprobs), ``presence_penalty``, ``frequency_penalty`` in [-2, 2]
  (logit -= presence * (count > 0) + frequency * count over the tokens the
  choice generated so far).
* ``response_format``: null, ``{"type": "text"}``, ``{"type": "json_object"}``
  (the answer is a JSON object) or ``{"type": "json_schema", "schema": {...}}``
  (the answer validates against the schema); compact JSON unless the schema's
  ``x-guidance`` says otherwise.
* ``tools``: ``[{"name", "description"?, "parameters"?}]`` (parameters: a JSON
  schema, default any object; names: 1-64 of ``[A-Za-z0-9_-]``),
  ``tool_choice``: ``"auto"`` (default with tools), ``"none"``, ``"required"``
  or ``{"name": NAME}``; ``parallel_tool_calls`` (default true).  Tools are
  listed in a system-prompt section (symphony.lip.tools: Hermes/Qwen
  ``<tool_call>`` blocks; earlier calls and ``tool`` results are rendered the
  same way).  ``required``/named: the answer is one call (several with
  parallel_tool_calls) whose arguments validate against the tool's schema.
  ``auto``: the model answers in text or, once it writes ``<tool_call>``, the
  rest is constrained to calls (with ``response_format``: JSON text or calls,
  from the first token).  ``none``: the tools stay in the prompt (so a
  conversation's prompt does not change with tool_choice) but a call is never
  made: the answer ends where the model begins one (finish_reason ``stop``).
  Call markup is never sent as text.
* ``cache``: null (no prefix caching) or ``{"dir": KVFS_DIR, "trust": [USER,
  ...], "ttl"?: seconds (default 3600), "wait"?: seconds (default 30),
  "durable"?: bool (default false)}``: see Prefix caching.
* ``stream`` (bool, default true): false when the client waits for the whole
  answer; the output is then the same with fewer events (see Output).

**Output** (``send``, in this order):

1. ``{"event": "prompt", "prompt_tokens": N, "cached_tokens": M}`` once (M:
   prompt tokens whose KV was forked from the cache, not computed).
2. ``{"event": "text", "index": i, "text": str}``: choice i's next text (never
   part of a UTF-8 character or of a stop string; the stop string is not
   sent).  With logprobs, ``"logprobs": [{"token", "bytes", "logprob",
   "top_logprobs": [{"token", "bytes", "logprob"}, ...]}]``: one entry per token
   whose text the event completes (a token cut by a stop string comes with the
   last text; tokens wholly inside it are not reported), the model's raw
   log-softmax (before penalties, grammar and temperature), alternatives most
   probable first; ``token`` is the bytes as UTF-8 with ``\\xNN`` escapes for
   an incomplete character.
3. ``{"event": "tool_call", "index": i, "call": k, "id": "call_<24 hex>",
   "name": NAME, "arguments": str}`` when call k of choice i starts, then
   ``{"event": "tool_call", "index": i, "call": k, "arguments": str}``; the
   pieces concatenate to the arguments' JSON text.
4. ``{"event": "done", "index": i, "finish_reason": "stop"|"length"|"tool_calls",
   "completion_tokens": n}`` when choice i ends (n: tokens of the answer, an
   end-of-sequence token included).

Choices run in threads on copy-on-write forks of the prompt's KV (computed
once); their events interleave, each choice's in order.  Greedy output is
deterministic.  Exit status 0.

With ``stream`` false, a choice's first ``text`` or ``tool_call`` event goes
at once and the ones after it are merged (symphony.lip.serving.Events): one
``text`` event for the text between two other events (its logprobs
concatenated), one ``tool_call`` event for the rest of a call's arguments,
each at most ~32 KiB of JSON (more: several).  A 1,000-token answer is then
2 text events instead of ~1,000 (with top_logprobs 20, one per ~20 tokens),
and the events still concatenate to exactly the streamed answer.

**Errors**: ``{"event": "error", "status": S, "code": C, "message": str,
"param": str|null}``, nothing after it, exit status 2.  400
``invalid_request`` (bad fields, echo with logprobs, an empty prompt, a
template error), 400 ``context_length_exceeded`` (the prompt, or prompt +
max_tokens, beyond the context), 400 ``invalid_schema`` (llguidance rejects
the response or tool schema; its message), 429 ``kv_quota_exceeded``, 503
``kv_no_space``, 500 ``internal_error``.

**Prefix caching.** With ``cache``, KV is reused across requests the way
vLLM's automatic prefix caching does, block by block (symphony.lip.prefixcache
has the scheme): every full block of ``block`` = the kernel's page size (16)
tokens of every earlier prompt and answer is found by the hash chain of the
blocks' token ids, through one ``kv.lookup`` call on the chain files of
``cache.dir`` (made if missing; a KVFS path, e.g. ``/home/alice/serve-cache``:
components may not begin with a dot).  The longest cached chain is forked
copy-on-write, at most up to the prompt's last token (always computed), and
``cached_tokens`` is its length: a repeated system prompt or a conversation's
next turn recomputes only what follows the last full block they share (under
16 tokens of it).  Files count when owned by the user or a ``trust``ed user
and writable by nobody else.  The request's own file promises its prompt's
blocks while it computes them: a request arriving meanwhile with the same
prefix waits for them (at most ``cache.wait`` seconds, default 30, less when
the writer stops making progress for 10 s or ends; 0: never) and forks them,
so a burst with one system prompt computes it once.  After the answer (n = 1)
its blocks are added (up to a stop string).  The files are cache files
(deleted first under memory pressure, least recently used first: a later
lookup misses), expire after ``ttl`` seconds unless a hit renews them, and
have random names; the kernel keeps one file per distinct prompt (a
conversation's earlier turns' files are removed when the next one is done).
They are private (0600) unless ``trust`` names other users (0644).  With
``durable``, each file is also synced (its keys with it) to the kernel's
durable directory when its blocks are added, so that another kernel that
adopts it finds the conversation the same way.  Caching never fails a request: a refused directory gives no caching, a full quota
first removes the user's own least recently used unopened cache files.  A
``cache.dir`` that is not a valid KVFS path is a 400 (param ``cache.dir``).
"""
import secrets
import sys
import threading
import traceback

from symphony.lip import InvalidPath, NoSpace, QuotaExceeded, StreamDecoder, TokenizerError, info, kv, pred, tokenizer
from symphony.lip.decoding import Decoder
from symphony.lip.grammar import GrammarRejected, json_schema, lark, matcher, token_bytes
from symphony.lip.prefixcache import PrefixCache
from symphony.lip.serving import BadRequest, Events, Request
from symphony.lip.streaming import TextStream
from symphony.lip.tools import MARKER, CallParser, calls_grammar, render

SEED_MASK = (1 << 64) - 1


def main(*args):
    ev = Events()
    try:
        if len(args) != 1:
            raise BadRequest(f"serve takes one argument, the request as JSON ({len(args)} given)")
        req = Request.parse(args[0])
        ev = Events(coalesce=not req.stream)
        job = Job(req, ev)
    except BadRequest as e:
        ev.error(400, e.code, str(e), e.param)
        return 2
    try:
        job.run()
        ev.flush()
    except BadRequest as e:
        ev.error(400, e.code, str(e), e.param)
    except QuotaExceeded as e:
        ev.error(429, "kv_quota_exceeded", str(e))
    except NoSpace as e:
        ev.error(503, "kv_no_space", str(e))
    except Exception as e:                                   # noqa: BLE001 - never a traceback to the client
        traceback.print_exc(file=sys.stderr)
        ev.error(500, "internal_error", f"{type(e).__name__}: {e}")
    return 2 if ev.failed else 0


class Job:
    """One request: its prompt, grammars and cache, checked before anything is sent."""

    def __init__(self, req: Request, ev: Events):
        self.req, self.ev, self.tok = req, ev, tokenizer()
        self.info = info()
        self.prompt = self._prompt()
        L, ctx = len(self.prompt), self.info["max_context"]
        if L == 0:
            raise BadRequest("the prompt is empty", "prompt" if req.mode == "text" else "messages")
        if L >= ctx or (req.max_tokens or 0) + L > ctx:
            asked = f"{L + (req.max_tokens or 0)} tokens ({L} in the prompt, {req.max_tokens or 0} in the completion)"
            raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, you requested "
                             f"{asked}. Please reduce the length of the prompt or completion.",
                             "messages" if req.mode == "chat" else "prompt", "context_length_exceeded")
        self.max_tokens = req.max_tokens or ctx - L
        self.offered = bool(req.tools) and req.tool_choice != "none"
        self.grammar, self.calls = self._grammars()
        self.cache = None                            # the prefix cache (symphony.lip.prefixcache)
        self.failure, self.abort = None, False       # a choice thread's exception; stop the others

    def _prompt(self) -> list:
        req, tok = self.req, self.tok
        if req.mode == "text":
            if isinstance(req.prompt, str):
                return tok.encode(req.prompt)
            if any(not 0 <= t < tok.vocab_size for t in req.prompt):
                raise BadRequest(f"prompt token ids must be in [0, {tok.vocab_size})", "prompt")
            return list(req.prompt)
        try:
            return tok.encode_chat(render(req.messages, req.tools or None))
        except TokenizerError as e:
            raise BadRequest(str(e), "messages") from None

    def _grammars(self):
        """(matcher of the whole answer or None, matcher of calls after <tool_call> or None)."""
        req = self.req
        named = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
        for i, t in enumerate(req.tools if self.offered else ()):
            try:
                matcher(json_schema(t["parameters"]))
            except GrammarRejected as e:
                raise BadRequest(f"the schema of tool {t['name']!r} was rejected: {e}", f"tools[{i}].parameters",
                                 "invalid_schema") from None
        try:
            if self.offered and (req.tool_choice != "auto" or req.response_format is not None):
                g = calls_grammar(req.tools, only=named, parallel=req.parallel_tool_calls,
                                  text_schema=req.response_format if req.tool_choice == "auto" else None)
                return matcher(lark(g)), None
            text = matcher(json_schema(req.response_format)) if req.response_format is not None else None
            calls = matcher(lark(calls_grammar(req.tools, parallel=req.parallel_tool_calls))) \
                if self.offered else None
            return text, calls
        except GrammarRejected as e:
            raise BadRequest(f"the schema was rejected: {e}", "response_format", "invalid_schema") from None

    # ------------------------------------------------------------ running
    def run(self) -> None:
        req, L = self.req, len(self.prompt)
        base, M = self._base()
        self.ev.send({"event": "prompt", "prompt_tokens": L, "cached_tokens": M})
        with base:
            if req.n == 1:
                Choice(self, 0, base, self.prompt[M:]).run()
                return
            if L - 1 > M:
                pred(base, self.prompt[M:L - 1], output="argmax")
            threads = [threading.Thread(target=self._choice, args=(i, base)) for i in range(req.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if self.failure is not None:
                raise self.failure

    def _choice(self, i, base):
        try:
            with base.fork() as f:
                Choice(self, i, f, self.prompt[-1:]).run()
        except _Stopped:
            pass
        except BaseException as e:                           # noqa: BLE001 - reported by run()
            self.failure, self.abort = self.failure or e, True

    # ------------------------------------------------------------ the prefix cache
    def _base(self):
        """(the file the prompt goes into, prompt tokens it already holds): with
        ``cache``, the longest cached prefix of whole blocks, forked, the file
        itself promising the prompt's blocks to requests arriving meanwhile
        (with n > 1 the last prompt token is fed in each choice's fork)."""
        req, L = self.req, len(self.prompt)
        if not req.cache:
            return kv.create(), 0
        self.cache = PrefixCache(req.cache["dir"], block=int(self.info.get("page_size") or 16),
                                 user=self.info["user"], trust=req.cache["trust"], ttl=req.cache["ttl"],
                                 wait=req.cache["wait"], durable=req.cache.get("durable", False))
        try:
            return self.cache.open(self.prompt, limit=L - 1, promise=L if req.n == 1 else L - 1)
        except InvalidPath as e:
            raise BadRequest(f"cache.dir: {e}", "cache.dir") from None

    def publish(self, f, tokens, upto) -> None:
        """Make the full blocks of ``tokens[:upto]`` (held by ``f``) findable."""
        if self.cache is not None:
            self.cache.publish(f, tokens, min(upto, len(f)))


class Choice:
    """One choice: decode, turn the tokens into text or call events, finish."""

    def __init__(self, job: "Job", index: int, f, feed: list):
        self.job, self.i, self.f, self.feed, req = job, index, f, feed, job.req
        seed = None if req.seed is None else (req.seed + index) & SEED_MASK
        self.dec = Decoder(f, temperature=req.temperature, top_p=req.top_p, seed=seed,
                           presence=req.presence_penalty, frequency=req.frequency_penalty,
                           top_logprobs=req.top_logprobs if req.logprobs else None,
                           matcher=job.grammar.deep_copy() if job.grammar else None,
                           eos_ids=job.tok.eos_ids, vocab=job.info["vocab_size"], pred=pred)
        free = job.grammar is None                   # no grammar: <tool_call> in the text is a marker
        self.text = TextStream(job.tok, list(req.stop) + ([MARKER] if req.tools and free else []))
        self.out: list = []                          # the answer's tokens
        self.parser = self.calldec = None            # once the answer is calls
        self.undecided = [] if job.offered and not free and req.response_format is not None else None
        self.reason = None

    def run(self) -> None:
        job, req = self.job, self.job.req
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else job.tok.decode(job.prompt)
            self.send({"event": "text", "index": self.i, "text": echo})
        if job.offered and job.grammar is not None and self.undecided is None:
            self._calls()                                    # required / named: calls from the start
        while self.reason is None:
            budget = job.max_tokens - len(self.out)
            if budget <= 0:
                self.reason = "length"
                break
            if job.abort:
                raise _Stopped()
            step = self.dec.step(self.feed, budget)
            self.feed = [step[-1][0]] if step else []
            for t, lp in step:
                self.out.append(t)
                if t in job.tok.eos_ids:
                    self.reason = "tool_calls" if self.parser else "stop"
                    break
                self._token(t, lp)
                if self.reason is not None:
                    break
            if self.reason is None and (self.dec.done or not step):
                self.reason = "tool_calls" if self.parser else "stop"
        self._finish()

    def _token(self, t, lp) -> None:
        if self.undecided is not None:                       # text or calls: the first character says
            self.undecided.append((t, lp))
            head = self.job.tok.decode([x for x, _ in self.undecided], skip_special=True)
            if not head.strip():
                return
            toks, self.undecided = self.undecided, None
            if head.lstrip().startswith("<"):
                self._calls()
            for x, y in toks:
                self._token(x, y)
        elif self.parser is not None:
            self._call_events(self.parser.feed(self.calldec.push(t)))
        else:
            self._text(*self.text.push(t, (t, lp) if lp else None))
            if self.text.hit == MARKER and self.job.offered:
                self._switch()
            elif self.text.hit is not None:
                self.reason = "stop"

    def _switch(self) -> None:
        """The model wrote <tool_call> in free text: drop the tokens from the one
        where it began, keep the text before it, decode calls under their grammar."""
        L, cut = len(self.job.prompt), self.text.cut
        if len(self.f) > L + cut:
            self.f.truncate(L + cut)
        self.feed = self.job.tok.encode(self.text.cut_text)
        self.out = self.out[:cut] + self.feed
        self.dec.matcher = self.job.calls.deep_copy()
        self._calls()

    def _calls(self) -> None:
        self.parser, self.calldec = CallParser(), StreamDecoder(self.job.tok)

    def _call_events(self, events) -> None:
        for e in events:
            ev = {"event": "tool_call", "index": self.i, "call": e["call"]}
            if "name" in e:
                ev.update(id="call_" + secrets.token_hex(12), name=e["name"])
            ev["arguments"] = e["arguments"]
            self.send(ev)

    def _text(self, text, recs) -> None:
        if not text and not recs:
            return
        ev = {"event": "text", "index": self.i, "text": text}
        if self.job.req.logprobs:
            ev["logprobs"] = [dict(_entry(lp.logprob, t), top_logprobs=[
                _entry(v, j) for j, v in zip(lp.top_ids, lp.top_logprobs)]) for t, lp in recs]
        self.send(ev)

    def _finish(self) -> None:
        if self.undecided:                                    # ended before deciding: it was text
            toks, self.undecided = self.undecided, None
            for t, lp in toks:
                self._token(t, lp)
        if self.parser is not None:
            self._call_events(self.parser.feed(self.calldec.flush()) + self.parser.finish())
        else:
            self._text(*self.text.finish())
        self.send({"event": "done", "index": self.i, "finish_reason": self.reason,
                   "completion_tokens": len(self.out)})
        job, L = self.job, len(self.job.prompt)
        stopped = self.parser is None and self.text.hit is not None
        if job.req.n == 1:                                   # the next turn starts with prompt + answer
            job.publish(self.f, job.prompt + self.out, L + (self.text.cut if stopped else len(self.out)))

    def send(self, ev) -> None:
        if not self.job.ev.send(ev):
            raise _Stopped()


class _Stopped(Exception):
    """Another choice failed: this one stops quietly."""


def _entry(logprob, token) -> dict:
    b = token_bytes(token)
    return {"token": b.decode("utf-8", "backslashreplace"), "bytes": list(b), "logprob": logprob}

"""Serve one OpenAI-style request (chat or text completion) as the HTTP gateway asks; prefix caching as a policy.

    symphony run serve '{"mode": "chat", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

This is the program behind every `/v1/chat/completions`, `/v1/completions`,
`/v1/responses` and `/v1/messages` request of `symphony-gateway`.  An administrator may serve a
route with a program of their own: it must keep this contract.

**The contract** (the request's fields and bounds, the events, their order,
the errors) is declared once in `symphony.ipc.serving` and checked on both
sides (docs/reference/serving.md); `main` gets ONE argument, the request as
JSON, and refuses bad input with an ``error`` event, never a traceback.  How
this program honours it:

* chat: the messages go through the model's chat template (``developer`` is a
  system message; ``name`` is ignored).  text: ``prompt`` is a string or token
  ids; ``echo`` sends the prompt as the answer's first ``text`` event.
* Sampling: ``temperature`` 0 is greedy (deterministic), else the kernel
  samples with ``top_p``/``top_k``/``min_p`` and a seed per step derived from ``seed``;
  ``presence_penalty``/``frequency_penalty`` (logit -= presence * (count > 0) +
  frequency * count over the choice's own tokens) and ``logit_bias`` (added to
  the logits, in the kernel when it chooses) apply to every step.
* ``response_format``: JSON (compact unless the schema's ``x-guidance`` says
  otherwise), a JSON schema, a regex, one of a list of strings or a Lark
  grammar, through llguidance's token masks (symphony.lip.grammar).
* ``tools`` are listed in a system-prompt section (symphony.lip.tools:
  Hermes/Qwen ``<tool_call>`` blocks; earlier calls and ``tool`` results are
  rendered the same way).  ``required``/named: the answer is calls (several
  with ``parallel_tool_calls``) whose arguments validate against the tool's
  schema (objects that list their properties take no others), and the choice
  ends ``tool_calls``.  Never a runaway list: the first call streams as it
  comes, each later one is sent once written whole; a call that repeats an
  earlier one ends the answer, and one cut by ``max_tokens`` is dropped (the
  answer is the calls before it, ``tool_calls``; only a first call cut short
  ends ``length``).  ``auto``: the model answers in
  text or, once it writes ``<tool_call>``, the rest is constrained to calls
  (with ``response_format``: that format or calls, from the first token).
  ``none``: the tools stay in the prompt (so a conversation's prompt does not
  change with tool_choice) but a call is never made: the answer ends where the
  model begins one (finish_reason ``stop``).  Call markup is never sent as
  text; each call has one id (``call_<24 hex>``), sent with its first piece.
* ``logprobs``: one entry per token whose text the event completes (a token
  cut by a stop string comes with the last text; tokens wholly inside it are
  not reported), the model's raw log-softmax (before penalties, bias, grammar
  and temperature), alternatives most probable first; ``token`` is the bytes
  as UTF-8 with ``\\xNN`` escapes for an incomplete character.  Text is never
  part of a UTF-8 character or of a stop string; the stop string is not sent
  and ``done`` names it (``stop_sequence``).
* Choices run in threads on copy-on-write forks of the prompt's KV (computed
  once); their events interleave, each choice's in order.
* With ``stream`` false, a choice's first ``text`` or ``tool_call`` event goes
  at once and the ones after it are merged (symphony.lip.serving.Events): one
  ``text`` event for the text between two other events (its logprobs
  concatenated), one ``tool_call`` event for the rest of a call's arguments,
  each at most ~32 KiB of JSON (more: several).  A 1,000-token answer is then
  2 text events instead of ~1,000, and the events still concatenate to
  exactly the streamed answer.
* Errors: 400 ``invalid_request`` (bad fields, a template error, a token id
  outside the vocabulary), 400 ``context_length_exceeded`` (the prompt, or
  prompt + max_tokens, beyond the context), 400 ``invalid_schema`` (llguidance
  rejects the format or a tool's schema; its message), 429
  ``kv_quota_exceeded``, 503 ``kv_no_space``, 500 ``internal_error``; exit
  status 2.

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
from symphony.lip.grammar import GrammarRejected, format_grammar, format_rule, json_schema, lark, matcher, token_bytes
from symphony.lip.prefixcache import PrefixCache
from symphony.lip.serving import BadRequest, Events, Request
from symphony.lip.streaming import TextStream
from symphony.lip.tools import MARKER, CallParser, CallGuard, calls_grammar, render

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
        vocab = self.info["vocab_size"]
        if any(t >= vocab for t in req.logit_bias):
            raise BadRequest(f"logit_bias names a token outside the vocabulary [0, {vocab})", "logit_bias")
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
        req, fmt = self.req, self.req.response_format
        named = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
        for i, t in enumerate(req.tools if self.offered else ()):
            try:
                matcher(json_schema(t["parameters"]))
            except GrammarRejected as e:
                raise BadRequest(f"the schema of tool {t['name']!r} was rejected: {e}", f"tools[{i}].parameters",
                                 "invalid_schema") from None
        try:
            if self.offered and (req.tool_choice != "auto" or fmt is not None):
                g = calls_grammar(req.tools, only=named, parallel=req.parallel_tool_calls,
                                  text_rule=format_rule(fmt) if fmt is not None and req.tool_choice == "auto"
                                  else None)
                return matcher(lark(g)), None
            text = matcher(format_grammar(fmt)) if fmt is not None else None
            calls = matcher(lark(calls_grammar(req.tools, parallel=req.parallel_tool_calls))) \
                if self.offered else None
            return text, calls
        except GrammarRejected as e:
            raise BadRequest(f"the {'schema' if 'Json' in type(fmt).__name__ else 'format'} was rejected: {e}",
                             "response_format", "invalid_schema") from None

    # ------------------------------------------------------------ running
    def run(self) -> None:
        req, L = self.req, len(self.prompt)
        if req.count_only:
            self.ev.send({"event": "prompt", "prompt_tokens": L, "cached_tokens": 0})
            return
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
        self.dec = Decoder(f, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                           seed=seed,
                           logit_bias=req.logit_bias, presence=req.presence_penalty, frequency=req.frequency_penalty,
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
        self.parser, self.calldec, self.guard = CallParser(), StreamDecoder(self.job.tok), CallGuard()

    def _call_events(self, events, last: bool = False) -> None:
        events = self.guard.push(events, self.parser.ended)
        if last:
            events += self.guard.finish()
            if self.reason == "length" and self.parser.ended and self.guard.sent:
                self.reason = "tool_calls"                   # the calls written whole; the one begun is dropped
        if self.guard.repeated is not None and self.reason is None:
            self.reason = "tool_calls"                       # it began to repeat a call: the answer ends
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
            self._call_events(self.parser.feed(self.calldec.flush()) + self.parser.finish(), last=True)
        else:
            self._text(*self.text.finish())
        job, L = self.job, len(self.job.prompt)
        stopped = self.parser is None and self.text.hit is not None
        done = {"event": "done", "index": self.i, "finish_reason": self.reason, "completion_tokens": len(self.out)}
        if stopped and self.text.hit != MARKER:
            done["stop_sequence"] = self.text.hit
        self.send(done)
        if self.parser is not None and (self.guard.repeated is not None or self.guard.cut
                                        or self.parser.ended < self.parser.calls):
            return                                           # its text ends in a dropped call: not cached
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

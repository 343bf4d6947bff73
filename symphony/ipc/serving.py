"""The serving program's contract, declared once: what the gateway asks a serving
program (``userland/serve.py``, or an administrator's own) and what it answers.

Every OpenAI or Anthropic request the gateway serves is one run of a serving
program: its one argument is a `ServeRequest` as JSON, and it answers with
events (``send(dict)``), each one of `EVENTS`, tagged by its ``event`` field::

    gateway  build_request(dict)  -> ServeRequest -> JSON argument   (ContractError: 400, the param named)
    program  parse_request(text)  -> ServeRequest                    (ContractError -> an error event)
    program  check_event(dict)    -> the event, as sent               (ContractError: a bug in the program)
    gateway  decode_event(data)   -> PromptEvent | TextEvent | ...    (ContractError: the run fails, 500)

In order, a run sends: one `PromptEvent`; then per choice its `TextEvent` and
`ToolCallEvent` pieces and one `DoneEvent` (choices interleave, each in its own
order); or, instead of anything after a refusal, one `ErrorEvent` (and exits
with status 2).  With ``count_only`` it sends the `PromptEvent` alone.

msgspec does the checking (strict types, bounds, unknown fields refused), on
both sides with the same words; `check` adds what spans several fields.  What
needs the model (the vocabulary, the context length, whether a schema
compiles) is the program's to check.  docs/reference/serving.md is generated
from these types (docs/gen_reference.py).
"""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType

from . import abi

__all__ = ["ContractError", "ServeRequest", "Message", "ToolCall", "Tool", "NamedTool", "Cache", "TextFormat",
           "JsonObjectFormat", "JsonSchemaFormat", "RegexFormat", "ChoiceFormat", "GrammarFormat", "Format",
           "PromptEvent", "TextEvent", "ToolCallEvent", "DoneEvent", "ErrorEvent", "Event", "EVENTS",
           "TokenLogprob", "TopLogprob", "build_request", "parse_request", "check_event", "decode_event",
           "MAX_N", "MAX_STOP", "MAX_TOOLS", "FINISH_REASONS"]

MAX_N = 16                      # choices a request may ask for
MAX_STOP = 16                   # stop strings
MAX_TOOLS = 1024
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 1024              # strings of a "choice" format
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
FINISH_REASONS = ("stop", "length", "tool_calls")
ROLES = ("system", "developer", "user", "assistant", "tool")


class ContractError(ValueError):
    """A request or event outside the contract; ``param`` names the field ('' for the whole)."""

    def __init__(self, message: str, param: str = ""):
        super().__init__(message)
        self.param = param


class _S(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A JSON object of exactly these fields."""


# ---------------------------------------------------------------- the request
class ToolCall(_S):
    """A call an assistant message made earlier (``arguments``: its JSON text)."""
    name: Annotated[str, Meta(min_length=1)]
    arguments: str
    id: str = ""


class Message(_S):
    """A chat message, its content flattened to one string (``developer`` is a system
    message; ``name`` is ignored)."""
    role: Literal[ROLES]
    content: Optional[str] = ""
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class Tool(_S):
    """A function the model may call (``parameters``: a JSON schema of an object; default any object)."""
    name: Annotated[str, Meta(pattern=TOOL_NAME)]
    description: Optional[str] = ""
    parameters: Optional[dict] = None


class NamedTool(_S):
    """``tool_choice`` naming the one tool to call."""
    name: str


class Cache(_S):
    """The prefix cache: chain files of whole blocks in KVFS directory ``dir``; the
    ``trust``ed users' files are used too; unused ones expire after ``ttl`` seconds; a
    request waits at most ``wait`` seconds for blocks another request is computing;
    ``durable``: each file is also synced to the kernel's durable directory."""
    dir: Annotated[str, Meta(pattern=r"^/")]
    trust: Annotated[list[Annotated[str, Meta(min_length=1, max_length=32)]], Meta(max_length=abi.MAX_TRUST)] = []
    ttl: Optional[Annotated[float, Meta(gt=0)]] = 3600.0
    wait: Annotated[float, Meta(ge=0, le=abi.MAX_LOOKUP_WAIT_S)] = 30.0
    durable: bool = False


class TextFormat(_S, tag_field="type", tag="text"):
    """Free text (the same as no format)."""


class JsonObjectFormat(_S, tag_field="type", tag="json_object"):
    """A JSON object."""


class JsonSchemaFormat(_S, tag_field="type", tag="json_schema"):
    """JSON that validates against ``schema`` (compact unless the schema's ``x-guidance`` says otherwise)."""
    schema: dict


class RegexFormat(_S, tag_field="type", tag="regex"):
    """Text that matches ``pattern`` whole (llguidance's regex syntax, Rust's ``regex`` crate)."""
    pattern: Annotated[str, Meta(min_length=1, max_length=1 << 16)]


class ChoiceFormat(_S, tag_field="type", tag="choice"):
    """Exactly one of ``choices``."""
    choices: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1, max_length=MAX_CHOICES)]


class GrammarFormat(_S, tag_field="type", tag="grammar"):
    """Text of a Lark grammar (llguidance's dialect: ``start`` is the answer; ``%json {...}`` embeds a schema)."""
    grammar: Annotated[str, Meta(min_length=1, max_length=1 << 20)]


Format = Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, ChoiceFormat, GrammarFormat]

_Bias = Annotated[float, Meta(ge=-abi.MAX_LOGIT_BIAS_VALUE, le=abi.MAX_LOGIT_BIAS_VALUE)]
_Prompt = Union[str, list[Annotated[int, Meta(ge=0)]]]


class ServeRequest(_S):
    """One request: the argument of the serving program.

    ``mode`` ``chat`` takes ``messages`` (and tools); ``text`` takes ``prompt`` (a
    string or token ids) and ``echo`` (the answer's text starts with the prompt).
    ``max_tokens`` null: up to the end of the context.  ``temperature`` 0 is greedy;
    ``top_k`` 0 is off; ``min_p`` drops tokens less likely than min_p times the most
    likely one (0 is off); choice i samples with ``seed`` + i.  ``logprobs``: each
    token's log-probability under the model (raw log-softmax), with the
    ``top_logprobs`` most likely alternatives.  ``presence_penalty`` and
    ``frequency_penalty`` as OpenAI defines them; ``logit_bias``: (token id, bias)
    pairs added to the logits (the bias a token gets in every choice and step).
    ``response_format`` constrains the answer; ``tools`` with ``tool_choice``
    (``auto``, ``none``, ``required`` or a `NamedTool`) and ``parallel_tool_calls``
    let it call functions.  ``stream`` false: the client waits for the whole
    answer (the program may merge its events).  ``count_only``: render and count
    the prompt, send the `PromptEvent`, stop.  A null field has its default."""
    mode: Literal["chat", "text"]
    messages: Union[Annotated[list[Message], Meta(min_length=1, max_length=100000)], UnsetType] = UNSET
    prompt: Union[_Prompt, UnsetType] = UNSET
    echo: Union[Optional[bool], UnsetType] = UNSET
    max_tokens: Optional[Annotated[int, Meta(ge=1, le=1 << 30)]] = None
    temperature: Optional[Annotated[float, Meta(ge=0, le=2)]] = 1.0
    top_p: Optional[Annotated[float, Meta(gt=0, le=1)]] = 1.0
    top_k: Optional[Annotated[int, Meta(ge=0, le=1 << 31)]] = 0
    min_p: Optional[Annotated[float, Meta(ge=0, le=1)]] = 0.0
    seed: Optional[Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]] = None
    stop: Optional[Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=MAX_STOP)]] = []
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]] = 0
    presence_penalty: Optional[Annotated[float, Meta(ge=-2, le=2)]] = 0.0
    frequency_penalty: Optional[Annotated[float, Meta(ge=-2, le=2)]] = 0.0
    logit_bias: Optional[Annotated[list[tuple[Annotated[int, Meta(ge=0)], _Bias]],
                                   Meta(max_length=abi.MAX_LOGIT_BIAS)]] = []
    response_format: Optional[Format] = None
    tools: Union[Optional[Annotated[list[Tool], Meta(max_length=MAX_TOOLS)]], UnsetType] = UNSET
    tool_choice: Union[Literal["auto", "none", "required"], NamedTool, None, UnsetType] = UNSET
    parallel_tool_calls: Union[Optional[bool], UnsetType] = UNSET
    cache: Optional[Cache] = None
    stream: Optional[bool] = True
    count_only: Optional[bool] = False

    def __post_init__(self):
        """null is the default: every field but mode, messages, prompt and n may be null."""
        for name, default in _NULL_DEFAULTS:
            if getattr(self, name) is None:
                setattr(self, name, default() if callable(default) else default)


_NULL_DEFAULTS = (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("stop", list), ("logprobs", False),
                  ("top_logprobs", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", list),
                  ("stream", True), ("count_only", False))


# ---------------------------------------------------------------- the events
class TopLogprob(_S):
    token: str                  # the token's bytes as UTF-8, \xNN for an incomplete character
    bytes: list[Annotated[int, Meta(ge=0, le=255)]]
    logprob: float


class TokenLogprob(_S):
    token: str
    bytes: list[Annotated[int, Meta(ge=0, le=255)]]
    logprob: float
    top_logprobs: list[TopLogprob] = []


_Index = Annotated[int, Meta(ge=0, le=MAX_N - 1)]
_Count = Annotated[int, Meta(ge=0)]


class PromptEvent(_S, tag_field="event", tag="prompt"):
    """First, once: the prompt's tokens, and how many of them were not computed (their
    KV came from the prefix cache)."""
    prompt_tokens: _Count
    cached_tokens: _Count = 0


class TextEvent(_S, tag_field="event", tag="text"):
    """Choice ``index``'s next text: never part of a UTF-8 character or of a stop string.
    ``logprobs``: one entry per token whose text the event completes."""
    index: _Index
    text: str
    logprobs: Optional[list[TokenLogprob]] = None


class ToolCallEvent(_S, tag_field="event", tag="tool_call"):
    """A piece of call ``call`` of choice ``index``: the first carries ``id`` (one id for
    the whole call) and ``name``; the pieces' ``arguments`` concatenate to its JSON text."""
    index: _Index
    call: Annotated[int, Meta(ge=0)]
    arguments: str
    id: Optional[Annotated[str, Meta(min_length=1, max_length=128)]] = None
    name: Optional[Annotated[str, Meta(pattern=TOOL_NAME)]] = None


class DoneEvent(_S, tag_field="event", tag="done"):
    """Choice ``index`` ended: at an end-of-sequence token or a stop string (``stop``; the
    string in ``stop_sequence``), at ``max_tokens`` (``length``), or after its calls
    (``tool_calls``).  ``completion_tokens``: the answer's tokens."""
    index: _Index
    finish_reason: Literal[FINISH_REASONS]
    completion_tokens: _Count
    stop_sequence: Optional[str] = None


class ErrorEvent(_S, tag_field="event", tag="error"):
    """The request was refused or failed (nothing follows): an HTTP status, an OpenAI
    error code (``invalid_request``, ``context_length_exceeded``, ``invalid_schema``,
    ``kv_quota_exceeded``, ``kv_no_space``, ``internal_error``) and the offending field."""
    status: Annotated[int, Meta(ge=400, le=599)]
    code: str
    message: str
    param: Optional[str] = None


Event = Union[PromptEvent, TextEvent, ToolCallEvent, DoneEvent, ErrorEvent]
EVENTS = (PromptEvent, TextEvent, ToolCallEvent, DoneEvent, ErrorEvent)


# ---------------------------------------------------------------- both sides
def build_request(fields: dict) -> ServeRequest:
    """The gateway's side: ``fields`` as a checked ServeRequest (ContractError naming the field)."""
    try:
        return check(msgspec.convert(fields, ServeRequest))
    except msgspec.ValidationError as e:
        raise _error(e) from None


def parse_request(text: Union[str, bytes]) -> ServeRequest:
    """The program's side: its argument as a checked ServeRequest (ContractError)."""
    try:
        return check(_REQUEST.decode(text))
    except msgspec.ValidationError as e:
        raise _error(e) from None
    except msgspec.DecodeError as e:
        raise ContractError(f"the request is not JSON: {e}") from None


def encode(obj) -> bytes:
    """A ServeRequest or an event as the JSON text that crosses."""
    return _ENCODER.encode(obj)


def check_event(ev: dict) -> dict:
    """The program's side: ``ev`` unchanged if it is an event of the contract (ContractError if not)."""
    try:
        msgspec.convert(ev, Event)
    except msgspec.ValidationError as e:
        raise _error(e) from None
    return ev


def decode_event(data) -> Event:
    """The gateway's side: an event a program sent (any JSON value) as its type (ContractError)."""
    try:
        return msgspec.convert(data, Event)
    except msgspec.ValidationError as e:
        raise _error(e) from None


def check(r: ServeRequest) -> ServeRequest:
    """What spans fields: the fields of the other mode absent, a named tool among the
    tools, top_logprobs only with logprobs, no echo with logprobs, tool names unique."""
    chat = r.mode == "chat"
    for name in (("prompt", "echo") if chat else ("messages", "tools", "tool_choice", "parallel_tool_calls")):
        if getattr(r, name) is not UNSET:
            raise ContractError(f"{name!r} is not a field of mode {r.mode!r}", name)
    if chat and r.messages is UNSET:
        raise ContractError("mode 'chat' needs messages", "messages")
    if not chat and r.prompt is UNSET:
        raise ContractError("mode 'text' needs a prompt", "prompt")
    if r.top_logprobs and not r.logprobs:
        raise ContractError("top_logprobs needs logprobs", "top_logprobs")
    if r.echo and r.logprobs:
        raise ContractError("echo together with logprobs is not supported", "echo")
    names = [t.name for t in r.tools or ()]
    if len(set(names)) < len(names):
        raise ContractError("tool names must be unique", "tools")
    if r.tool_choice == "required" and not names:
        raise ContractError("tool_choice 'required' needs tools", "tool_choice")
    if isinstance(r.tool_choice, NamedTool) and r.tool_choice.name not in names:
        raise ContractError(f"tool_choice names {r.tool_choice.name!r}, which is not among the tools", "tool_choice")
    if len({t for t, _ in r.logit_bias}) < len(r.logit_bias):
        raise ContractError("logit_bias names a token more than once", "logit_bias")
    if isinstance(r.response_format, ChoiceFormat) and len(set(r.response_format.choices)) < len(
            r.response_format.choices):
        raise ContractError("the choices must differ", "response_format.choices")
    if r.cache is not None and any(p.startswith(".") for p in r.cache.dir.split("/")):
        raise ContractError("cache.dir: path components may not begin with a dot", "cache.dir")
    return r


# ---------------------------------------------------------------- helpers
_REQUEST = msgspec.json.Decoder(ServeRequest)
_ENCODER = msgspec.json.Encoder()
_AT = re.compile(r" - at `\$\.?(.*)`$")


def _error(e: msgspec.ValidationError) -> ContractError:
    """msgspec's message with the field it names as ``param`` (an unknown field: its name)."""
    msg = str(e)
    m = _AT.search(msg)
    param = m.group(1) if m else ""
    unknown = re.match(r"Object contains unknown field `([^`]*)`", msg)
    if unknown:
        field = unknown.group(1)[:64]
        param = f"{param}.{field}" if param else field
        msg = f"unknown field {field!r}" + (f" in {m.group(1)}" if m and m.group(1) else "")
    return ContractError(msg, param)

"""OpenAI request bodies, decoded and validated by type with msgspec.

`decode(body, Type)` turns a request body into a typed object or raises
`ApiError` (400, naming the parameter: ``$.messages[0].role``).  Unknown
fields are ignored, as OpenAI's own SDKs send fields a server may not know;
fields whose values Symphony cannot honour are refused by the route with a
clear message instead (`unsupported`).  Ranges follow OpenAI's documentation;
``n`` and ``top_logprobs`` are bounded by what one LIP serves well.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

import msgspec

from .errors import ApiError
from .files import inline_text

MAX_N = 16
MAX_STOP = 4
MAX_TOOLS = 128
MAX_KV_FILES = 16

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
Seed = Annotated[int, msgspec.Meta(ge=-(2 ** 63), le=2 ** 63 - 1)]
Stop = Union[str, Annotated[list[str], msgspec.Meta(max_length=MAX_STOP)], None]


class Base(msgspec.Struct, omit_defaults=True):
    pass


# ---------------------------------------------------------------- shared pieces
class Part(Base):
    """A content part: text (``text``, ``input_text``, ``output_text``), a file
    (``input_file`` / ``file``: its text is read when it is a text file given
    inline as a data URL), or something the text models cannot read (images,
    audio, other files)."""
    type: str
    text: Optional[str] = None
    filename: Optional[str] = None
    file_data: Optional[str] = None
    file: Optional[dict] = None


Content = Union[str, list[Part], None]


class FunctionDef(Base):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ChatTool(Base):
    type: Literal["function"]
    function: FunctionDef


class JsonSchemaFormat(Base):
    name: Optional[str] = None
    schema: Optional[dict] = None
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponseFormat(Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(Base):
    include_usage: bool = False


# ---------------------------------------------------------------- vLLM's extra parameters
LogitBias = dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]]


class StructuredOutputs(Base, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: the answer is exactly one of ``choice``, matches
    ``regex``, is JSON of schema ``json``, or follows the Lark ``grammar`` (one of them)."""
    choice: Optional[Annotated[list[str], msgspec.Meta(min_length=1)]] = None
    regex: Optional[str] = None
    json: Union[dict, str, None] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Any = None
    whitespace_pattern: Optional[str] = None
    disable_any_whitespace: Optional[bool] = None
    disable_additional_properties: Optional[bool] = None
    disable_fallback: Optional[bool] = None


class Extras(Base, kw_only=True):
    """What vLLM's OpenAI server takes beyond OpenAI's fields (the ``extra_body`` of the
    ``openai`` package), for chat and completions: ``top_k`` (-1 or 0: off), ``min_p``
    (0: off), and the answer constrained by ``structured_outputs`` or its older names
    ``guided_*``."""
    top_k: Optional[Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)]] = None
    min_p: Optional[Annotated[float, msgspec.Meta(ge=0, le=1)]] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_choice: Optional[Annotated[list[str], msgspec.Meta(min_length=1)]] = None
    guided_regex: Optional[str] = None
    guided_json: Union[dict, str, None] = None
    guided_grammar: Optional[str] = None


# ---------------------------------------------------------------- chat completions
class ToolCallFunction(Base):
    name: str
    arguments: str = ""


class ToolCall(Base):
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class Message(Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class ChatRequest(Extras):
    model: str
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_tokens: Optional[PositiveInt] = None
    max_completion_tokens: Optional[PositiveInt] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    n: Optional[N] = None
    seed: Optional[Seed] = None
    stop: Stop = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[Annotated[list[ChatTool], msgspec.Meta(max_length=MAX_TOOLS)]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    logit_bias: Optional[LogitBias] = None
    user: Optional[str] = None


# ---------------------------------------------------------------- completions
class CompletionRequest(Extras):
    model: str
    prompt: Union[str, list[Union[str, int, list[int]]]]    # text, texts, token ids, token id lists
    max_tokens: Optional[PositiveInt] = 16
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    n: Optional[N] = None
    seed: Optional[Seed] = None
    stop: Stop = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Annotated[int, msgspec.Meta(ge=0, le=20)]] = None
    echo: bool = False
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    best_of: Optional[PositiveInt] = None
    suffix: Optional[str] = None
    logit_bias: Optional[LogitBias] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None


# ---------------------------------------------------------------- responses
class ResponseItem(Base):
    """One input item: a message (``type`` "message" or absent, with ``role``),
    a ``function_call`` the model made earlier, a ``function_call_output``, or a
    ``compaction`` (from ``/v1/responses/compact``)."""
    type: Optional[str] = None
    role: Optional[Literal["system", "developer", "user", "assistant"]] = None
    content: Content = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, list[Part], None] = None
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None   # an assistant message's
    encrypted_content: Optional[str] = None                          # a compaction item's


class ResponseTool(Base):
    type: str
    name: Optional[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]] = None
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class TextFormat(Base):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema: Optional[dict] = None
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Base):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ResponsesRequest(Base):
    model: str
    input: Union[str, list[ResponseItem], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Optional[PositiveInt] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    seed: Optional[Seed] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    top_logprobs: Optional[TopLogprobs] = None
    include: Optional[list[str]] = None
    tools: Optional[Annotated[list[ResponseTool], msgspec.Meta(max_length=MAX_TOOLS)]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    max_tool_calls: Optional[PositiveInt] = None
    background: Optional[bool] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


class CompactRequest(Base):
    """POST /v1/responses/compact: the conversation (``input``, after the stored one of
    ``previous_response_id``) to compact."""
    model: str
    input: Union[str, list[ResponseItem], None] = None
    previous_response_id: Optional[str] = None
    instructions: Optional[str] = None
    prompt_cache_key: Optional[str] = None


# ---------------------------------------------------------------- LIPs over HTTP
class LipRequest(Base):
    """POST /v1/lips: a LIP to run (``program``: a stock program's name, or
    ``source``: a LIP's text), its arguments, grants and limits, and the KV
    files it will open (``kv_files``: with several kernels, it runs on the
    one holding them)."""
    program: Optional[str] = None
    source: Optional[Annotated[str, msgspec.Meta(max_length=4 << 20)]] = None
    filename: Optional[Annotated[str, msgspec.Meta(max_length=200)]] = None
    args: list[str] = []
    grants: dict[str, list[str]] = {}
    limits: dict[str, float] = {}
    priority: Literal["batch", "normal", "interactive"] = "normal"
    kv_tokens: Optional[Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]] = None
    kv_files: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]],
                        msgspec.Meta(max_length=MAX_KV_FILES)] = []


class LipInput(Base):
    data: Optional[str] = None
    eof: bool = False


# ---------------------------------------------------------------- decoding
_AT = re.compile(r" - at `\$\.?(.*)`$")


def decode(body: bytes, typ):
    """``body`` as a ``typ``; ApiError 400 naming the parameter when it is not."""
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise _invalid(e) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def convert(obj, typ):
    """``obj`` (decoded JSON) as a ``typ``; ApiError 400 naming the parameter when it is not."""
    try:
        return msgspec.convert(obj, type=typ)
    except msgspec.ValidationError as e:
        raise _invalid(e) from None


def _invalid(e: msgspec.ValidationError) -> ApiError:
    """The 400 of a body that does not fit its type, naming the parameter (a missing
    field: the field itself)."""
    msg = str(e)
    m = _AT.search(msg)
    param = (m.group(1) if m else "") or ""
    missing = re.match(r"Object missing required field `([^`]*)`", msg)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return ApiError(400, f"invalid request: {msg}", param=param or None)


def text_of(content: Content, where: str, *, attachments: str = "refuse") -> str:
    """One string from a message's content (a string or parts).  A text file
    given inline (``file_data``: a ``data:text/...;base64,`` URL), or a PDF
    with text in it (read by pypdf: at most 2 MiB, its first 50 pages), is
    included as ``[file NAME]`` and its text.  An image or a file the model cannot read
    is refused (400), or with ``attachments="placeholder"`` replaced by a line
    saying what it was (``[image]``, ``[file NAME: application/pdf, 1234
    bytes, not readable as text]``).  Other parts (audio, ...) are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, p in enumerate(content):
        at = f"{where}[{i}]"
        if p.type in ("text", "input_text", "output_text", "refusal"):
            if p.text is None:
                raise ApiError(400, f"{at}: a {p.type} part needs 'text'", param=f"{at}.text")
            out.append(p.text)
            continue
        if p.type in ("input_file", "file"):
            f = p.file if isinstance(p.file, dict) else {}
            name = p.filename or f.get("filename") or "file"
            data = p.file_data or f.get("file_data")
            text, what = inline_text(data, at)
            if text is not None:
                out.append(f"[file {name}]\n{text}\n")
                continue
        elif p.type in ("image_url", "input_image"):
            what = "image"
        else:
            raise ApiError(400, f"{at}: content parts of type {p.type!r} are not supported: the model reads "
                                f"text only", param=f"{at}.type")
        if attachments != "placeholder":
            raise ApiError(400, f"{at}: content parts of type {p.type!r} ({what}) are not supported: the "
                                f"model reads text only", param=f"{at}.type")
        out.append("[image]" if what == "image" else f"[file {name}: {what}, not readable as text]")
    return "".join(out)

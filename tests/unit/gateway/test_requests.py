"""The serving program's requests the gateway builds from OpenAI requests (completions.py,
responses.py): each one the program's own check accepts (symphony.lip.serving.Request), and
``stream`` says whether the client streams, on every route."""
import orjson
import pytest

from symphony.gateway.completions import chat_request, completion_requests
from symphony.gateway.responses import serve_request
from symphony.gateway.schema import ChatRequest, CompletionRequest, ResponsesRequest, decode
from symphony.lip.serving import Request

MSGS = [{"role": "user", "content": "Hi"}]


def built(route, body):
    if route == "chat":
        return [chat_request(decode(orjson.dumps(body), ChatRequest), "refuse")]
    if route == "completions":
        return completion_requests(decode(orjson.dumps(body), CompletionRequest))
    r = decode(orjson.dumps(body), ResponsesRequest)
    return [serve_request(r, [{"role": "user", "content": r.input}])[0]]


@pytest.mark.parametrize("route,body", [
    ("chat", {"model": "m", "messages": MSGS, "n": 2, "logprobs": True, "top_logprobs": 2, "stop": "x"}),
    ("completions", {"model": "m", "prompt": ["a b", "c"], "max_tokens": 4, "logprobs": 1}),
    ("responses", {"model": "m", "input": "Hi", "max_output_tokens": 8}),
])
@pytest.mark.parametrize("stream", [None, False, True])
def test_stream_reaches_the_program(route, body, stream):
    if stream is not None:
        body = dict(body, stream=stream)
    reqs = built(route, body)
    assert reqs and all(r["stream"] is bool(stream) for r in reqs)
    for r in reqs:
        assert Request.parse(orjson.dumps(dict(r, cache=None))).stream is bool(stream)


def test_kv_files_a_client_sends_are_bounded():
    """A hostile POST /v1/lips: too many kv_files, an empty one, a path past 4 KiB, not a list:
    each a 400 naming kv_files (the router asks every kernel about each file it keeps)."""
    import orjson
    import pytest
    from symphony.gateway.errors import ApiError
    from symphony.gateway.schema import MAX_KV_FILES, LipRequest
    ok = decode(orjson.dumps({"program": "chat", "kv_files": ["/home/a/x.kv"] * MAX_KV_FILES}), LipRequest)
    assert len(ok.kv_files) == MAX_KV_FILES
    for bad in (["/x"] * (MAX_KV_FILES + 1), [""], ["/" + "a" * 4096], "/x"):
        with pytest.raises(ApiError) as e:
            decode(orjson.dumps({"program": "chat", "kv_files": bad}), LipRequest)
        assert e.value.status == 400 and e.value.param and "kv_files" in e.value.param


# ---------------------------------------------------------------- inputs the gateway reads itself
def _pdf(text: str) -> bytes:
    """A well-formed one-page PDF (with its xref table) showing ``text``."""
    stream = f"BT /F1 12 Tf 72 72 Td ({text}) Tj ET".encode()
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 144] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, o in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + o + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def test_a_pdf_is_read_as_text_and_an_unreadable_one_is_a_placeholder():
    import base64
    from symphony.gateway.errors import ApiError
    from symphony.gateway.schema import Part, text_of
    url = lambda b: "data:application/pdf;base64," + base64.b64encode(b).decode()   # noqa: E731
    part = Part(type="input_file", filename="t.pdf", file_data=url(_pdf("Title: A Fixture")))
    assert text_of([part], "x", attachments="refuse") == "[file t.pdf]\nTitle: A Fixture\n"
    broken = Part(type="input_file", filename="b.pdf", file_data=url(b"%PDF-1.4 " + b"\x00garbage" * 300))
    assert text_of([broken], "x", attachments="placeholder") == \
        "[file b.pdf: application/pdf, 2409 bytes, not readable as text]"
    with pytest.raises(ApiError) as e:
        text_of([broken], "input[0].content", attachments="refuse")
    assert e.value.status == 400 and e.value.param == "input[0].content[0].type"
    # no cross-reference table, no startxref (hand-written and truncated files): rebuilt from where
    # the objects are, as readers repair it; with the table's offsets wrong, the same
    whole = _pdf("Title: No Table")
    bare = whole[:whole.index(b"xref")] + b"trailer\n<< /Root 1 0 R >>\n%%EOF"
    no_trailer = whole[:whole.index(b"xref")]                      # the catalog found by its /Type
    shifted = b"%PDF-1.4\n% a comment that moves every object\n" + whole[len(b"%PDF-1.4\n"):]
    for raw in (bare, no_trailer, shifted):
        part = Part(type="input_file", filename="n.pdf", file_data=url(raw))
        assert text_of([part], "x", attachments="refuse") == "[file n.pdf]\nTitle: No Table\n"
    no_catalog = bare.replace(b"/Type /Catalog", b"/Type /Other").replace(b"/Root 1 0 R", b"")
    assert text_of([Part(type="input_file", filename="c.pdf", file_data=url(no_catalog))], "x",
                   attachments="placeholder").startswith("[file c.pdf: application/pdf,")
    # a hostile "PDF" (within the 2 MiB read): objects that never close, a huge object number, a
    # catalog after 200,000 objects: each a placeholder or text, in one linear pass each
    for raw in (b"%PDF-1.4\n" + b"1 0 obj<<" * 200_000, b"%PDF-1.4\n9999999 0 obj<< /Type /Catalog >>\n",
                b"%PDF-1.4\n" + b"/Root " * 300_000, b"%PDF-1.4\n" + b"1 0 obj<<" * 200_000 + b"/Type /Catalog"):
        out = text_of([Part(type="input_file", filename="h.pdf", file_data=url(raw))], "x", attachments="placeholder")
        assert out.startswith("[file h.pdf")


def test_a_pdf_is_read_off_the_event_loop_and_its_text_used_by_the_route(monkeypatch):
    """The route's conversion takes the text read in the PDF pool; meanwhile the loop runs."""
    import asyncio
    import base64
    import threading
    import time
    from symphony.gateway import files
    from symphony.gateway.schema import Part, text_of
    url = "data:application/pdf;base64," + base64.b64encode(_pdf("Title: Pooled")).decode()
    real, threads = files.pdf_text, []

    def slow(raw):                                  # a large file: 0.4 s of reading
        threads.append(threading.get_ident())
        time.sleep(0.4)
        return real(raw)
    monkeypatch.setattr(files, "pdf_text", slow)

    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)
        t = asyncio.create_task(ticker())
        body = orjson.dumps({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_file", "filename": "p.pdf", "file_data": url}]}]})
        async with files.pdfs_read(body):
            assert len(ticks) >= 20                 # the loop ran while the file was read
            out = text_of([Part(type="input_file", filename="p.pdf", file_data=url)], "x")
        t.cancel()
        return out
    assert asyncio.run(main()) == "[file p.pdf]\nTitle: Pooled\n"
    assert threads and threading.get_ident() not in threads and len(threads) == 1   # read once, in the pool
    assert files._read.get() is None                # nothing kept past the request
    # a body without a PDF, or not JSON at all, reads nothing (its route reports the JSON error)
    assert asyncio.run(files.read_pdfs(b'{"input": "hi"}')) is None
    assert asyncio.run(files.read_pdfs(b'{"x": "data:application/pdf;base64,' + b"{")) is None
    # a body whose JSON escapes the slash is still found (and read off the loop)
    escaped = orjson.dumps({"x": url}).replace(b"application/pdf", b"application\\/pdf")
    assert asyncio.run(files.read_pdfs(escaped)) == {url: "Title: Pooled"}


def test_a_compaction_carries_its_summary_and_nothing_else_is_taken():
    import base64
    import zlib
    from symphony.gateway.errors import ApiError
    from symphony.gateway.items import MAX_SEALED, SEAL, seal, unseal
    assert unseal(seal("the code word is slate"), "x") == "the code word is slate"
    bomb = SEAL + base64.urlsafe_b64encode(zlib.compress(b"{" + b" " * (MAX_SEALED * 4))).decode()
    for bad in ("plain text", SEAL + "!!!", SEAL + base64.urlsafe_b64encode(b"not zlib").decode(), bomb,
                SEAL + base64.urlsafe_b64encode(zlib.compress(b'{"v": 2, "summary": "x"}')).decode()):
        with pytest.raises(ApiError) as e:
            unseal(bad, "input[0].encrypted_content")
        assert e.value.status == 400 and e.value.param == "input[0].encrypted_content"


def test_logit_bias_and_answer_formats_become_the_contracts():
    from symphony.gateway.errors import ApiError
    from symphony.gateway.tools import answer_format, logit_bias
    assert logit_bias({"7": 1.5, "0": -100.0}) == [[7, 1.5], [0, -100.0]] and logit_bias(None) == []
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, {"１": 1}, {str(i): 0 for i in range(1025)}):
        with pytest.raises(ApiError) as e:
            logit_bias(bad)
        assert e.value.param == "logit_bias"

    def fmt(**body):
        return answer_format(decode(orjson.dumps({"model": "m", "messages": MSGS, **body}), ChatRequest))
    assert fmt() is None and fmt(response_format={"type": "text"}) is None
    assert fmt(guided_choice=["a", "b"]) == {"type": "choice", "choices": ["a", "b"]}
    assert fmt(structured_outputs={"json": '{"type": "object"}'}) == {"type": "json_schema",
                                                                      "schema": {"type": "object"}}
    assert fmt(structured_outputs={"json_object": True}) == {"type": "json_object"}
    for body, param in [(dict(guided_regex="a", guided_grammar="start: 'a'"), "guided_grammar"),
                        (dict(structured_outputs={"choice": ["a"]}, guided_choice=["a"]), "guided_choice"),
                        (dict(guided_json="[1, 2]"), "guided_json"), (dict(guided_json="{nope"), "guided_json"),
                        (dict(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern")]:
        with pytest.raises(ApiError) as e:
            fmt(**body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)
    with pytest.raises(ApiError):                                       # an unknown structured_outputs field
        fmt(structured_outputs={"choices": ["a"]})


def test_anthropic_blocks_become_the_contracts_messages():
    from symphony.gateway.errors import ApiError
    from symphony.gateway.messages import MessagesRequest, _conversation

    def conv(messages, **kw):
        return _conversation(decode(orjson.dumps({"model": "m", "max_tokens": 5, "messages": messages, **kw}),
                                    MessagesRequest), "placeholder")
    got = conv([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": {}},
                                             {"type": "document", "title": "T",
                                              "source": {"type": "text", "data": "doc text"}}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "b"},
                                                  {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                              "content": [{"type": "text", "text": "boom"}]},
                                             {"type": "text", "text": "and?"}]}], system="sys")
    assert got == [{"role": "system", "content": "sys"},
                   {"role": "user", "content": "a\n[image]\n[document T]\ndoc text\n"},
                   {"role": "assistant", "content": "b", "tool_calls": [{"id": "t1", "name": "f",
                                                                          "arguments": '{"x": 1}'}]},
                   {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},
                   {"role": "user", "content": "and?"}]
    for messages in ([{"role": "user", "content": [{"type": "audio"}]}],
                     [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}],
                     [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "pre"}]):
        with pytest.raises(ApiError) as e:
            conv(messages)
        assert e.value.status == 400 and e.value.body("anthropic")["error"]["type"] == "invalid_request_error"


def test_admission_is_told_what_an_answer_is_expected_to_need_not_its_whole_limit():
    """The gateway's KV hint: the prompt (~3 characters a token) plus an answer of at most
    EXPECTED_ANSWER tokens per choice, within the context; a smaller limit counts as it is."""
    from symphony.gateway.serving import EXPECTED_ANSWER, _kv_estimate
    chat = {"mode": "chat", "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 2048}
    assert _kv_estimate(chat, 8192) == 100 + 64 + EXPECTED_ANSWER
    assert _kv_estimate(dict(chat, max_tokens=10), 8192) == 100 + 64 + 10
    assert _kv_estimate(dict(chat, max_tokens=None, n=3), 8192) == 100 + 64 + 3 * EXPECTED_ANSWER
    assert _kv_estimate({"mode": "completion", "prompt": list(range(5000)), "max_tokens": 4000}, 4096) == 4096


def test_one_key_sending_many_pdfs_holds_one_reader_and_another_key_is_read_meanwhile(monkeypatch):
    """A flood of PDF requests from one key waits its turn outside the pool (one job a key), so
    another key's PDF is read by the pool's other thread, not after the whole flood."""
    import asyncio
    import base64
    import time
    from symphony.gateway import files
    monkeypatch.setattr(files, "pdf_text", lambda raw: time.sleep(0.3) or "text")
    body = lambda i: orjson.dumps({"input": [{"type": "input_file", "file_data": (   # noqa: E731
        "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4 " + str(i).encode()).decode())}]})

    async def main():
        t0 = time.monotonic()
        done = {}

        async def one(who, i):
            got = await files.read_pdfs(body(i), who)
            assert list(got.values()) == ["text"]
            done[(who, i)] = time.monotonic() - t0
        flood = [asyncio.create_task(one("alice", i)) for i in range(6)]
        await asyncio.sleep(0.05)
        await one("bob", 99)
        await asyncio.gather(*flood)
        return done
    done = asyncio.run(main())
    alice = sorted(t for (who, _), t in done.items() if who == "alice")
    assert alice[-1] >= 6 * 0.3 * 0.9                       # her six, one at a time
    assert done[("bob", 99)] < 0.8, done                    # bob's, beside hers (alone: 0.3 s)

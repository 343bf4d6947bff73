"""The ABI declared once (symphony/ipc/abi.py) and each op's body type (symphony/ipc/schema.py):
good bodies decode, bad ones are refused naming the field, the same way on both sides; the
top-k arena arrives as what the kernel wrote.  No kernel process: the kernel side's decode is
the one `SyscallServer._handle` calls."""
from __future__ import annotations

import ast
import secrets
from pathlib import Path

import numpy as np
import orjson
import pytest

from symphony.ipc import abi, layout, schema
from symphony.ipc.kernel_side import KernelSide
from symphony.ipc.lip_side import LipSide

REPO = Path(__file__).resolve().parents[3]

# one good body per op: every op of the ABI
GOOD = {
    abi.NOP: {}, abi.INFO: {}, abi.RECV: {},
    abi.PRED: {"kv": 3, "n_tokens": 2, "positions": [0, 1], "all_logits": True, "output": "sample",
               "k": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1, "n_mask_words": 2},
    abi.KV_CREATE: {"path": "/tmp/a.kv", "mode": 0o644}, abi.KV_OPEN: {"path": "/tmp/a.kv", "mode": "rw"},
    abi.KV_CLOSE: {"kv": 1}, abi.KV_SYNC: {"kv": 1}, abi.KV_REMOVE: {"path": "/tmp/a.kv"},
    abi.KV_RMDIR: {"path": "/tmp/d"}, abi.KV_LIST: {"path": "/"}, abi.KV_MKDIR: {"path": "/tmp/d", "mode": None},
    abi.KV_FORK: {"kv": 1, "path": None, "mode": None}, abi.KV_TRUNCATE: {"kv": 1, "n": 0},
    abi.KV_EXTRACT: {"kv": 1, "ranges": [[0, 4], [8, 9]]}, abi.KV_MERGE: {"kvs": [1, 2], "path": "/tmp/m.kv"},
    abi.KV_STAT: {"path": "/tmp/a.kv"}, abi.KV_ADVISE: {"kv": 1, "hint": "expire", "seconds": 2.5},
    abi.KV_RENAME: {"old": "/tmp/a.kv", "new": "/tmp/b.kv"},
    abi.KV_LOOKUP: {"dir": "/home/a/c", "block": 16, "n_keys": 3, "limit": 2, "wait": 1.5, "claim": True,
                    "trust": ["bob"], "mode": 0o644, "ttl": 60.0},
    abi.KV_PUBLISH: {"kv": 1, "block": 32, "n_keys": 0, "ttl": None},
    abi.SEND: {"data": {"any": ["json", 1, None]}}, abi.WRITE_STREAM: {"stream": "stderr", "data": "x"},
    abi.FETCH: {"id": 1, "offset": 0},
    abi.CAP_HTTP: {"url": "http://h/", "method": "POST", "body": "b", "headers": {"a": "b"}, "timeout": 2},
    abi.CAP_READ_FILE: {"path": "/data/x", "max_bytes": 10}, abi.CAP_LIST_DIR: {"path": "/data"},
}

# (op, body, field named, words the message must hold): wrong types, missing fields, out-of-range values
BAD = [
    (abi.KV_LOOKUP, {"dir": "/d", "block": 16, "n_keys": 2049}, "n_keys", "n_keys must be an int in [0, 2048]"),
    (abi.KV_LOOKUP, {"dir": "/d", "block": 0, "n_keys": 1}, "block", "block must be an int in [1, 4096]"),
    (abi.KV_LOOKUP, {"dir": "/d", "block": 16, "n_keys": 1, "wait": 301}, "wait",
     "wait must be a number of seconds in [0, 300], got 301"),
    (abi.KV_LOOKUP, {"dir": "/d", "block": 16, "n_keys": 1, "wait": -1}, "wait", "got -1"),
    (abi.KV_LOOKUP, {"dir": "/d", "block": 16, "n_keys": 1, "trust": ["x"] * 257}, "trust",
     "trust must be a list of at most 256 user names"),
    (abi.KV_LOOKUP, {"dir": "/d", "block": 16, "n_keys": 1, "trust": [""]}, "trust", "trust must be"),
    (abi.KV_LOOKUP, {"dir": "/d", "block": 16, "n_keys": 1, "limit": -1}, "limit", "limit must be an int >= 0"),
    (abi.KV_LOOKUP, {"block": 16, "n_keys": 1}, "dir", "dir is required"),
    (abi.KV_PUBLISH, {"kv": 1, "block": 16, "n_keys": 1, "ttl": -2}, "ttl", "ttl must be a number of seconds"),
    (abi.PRED, {"kv": 0, "n_tokens": "3"}, "n_tokens", "n_tokens must be an int in [1, 8192], got '3'"),
    (abi.PRED, {"kv": 0, "n_tokens": True}, "n_tokens", "n_tokens must be an int in [1, 8192], got True"),
    (abi.PRED, {"kv": 0, "n_tokens": 1.0}, "n_tokens", "got 1.0"),
    (abi.PRED, {"kv": 0, "n_tokens": 0}, "n_tokens", "n_tokens must be an int in [1, 8192], got 0"),
    (abi.PRED, {"kv": 0, "n_tokens": 8193}, "n_tokens", "got 8193"),
    (abi.PRED, {"kv": 0}, "n_tokens", "n_tokens is required"),
    (abi.PRED, {"n_tokens": 1}, "kv", "kv is required: kv must be a KV handle"),
    (abi.PRED, {"kv": "0", "n_tokens": 1}, "kv", "kv must be a KV handle (an int), got '0'"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "k": 0}, "k", "k must be an int in [1, 1024], got 0"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "k": 1025}, "k", "got 1025"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "n_mask_words": -1}, "n_mask_words", "n_mask_words must be an int in [0, "),
    (abi.PRED, {"kv": 0, "n_tokens": 2, "positions": [0, -1]}, "positions", "positions must be a list of ints >= 0"),
    (abi.PRED, {"kv": 0, "n_tokens": 2, "positions": [0]}, "positions", "positions and tokens differ in length"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "positions": "01"}, "positions", "positions must be"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "output": "probs"}, "output", "output must be one of ('logits', 'topk'"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "all_logits": 1}, "all_logits", "all_logits must be true or false, got 1"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "output": "sample", "temperature": 1e-300}, "temperature",
     "temperature must be 0 (greedy) or a number in [0.0001, 100.0], got 1e-300"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "output": "sample", "temperature": 101}, "temperature", "got 101"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "output": "sample", "top_p": 0.0}, "top_p",
     "top_p must be a number in (0, 1], got 0.0"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "top_k": -3}, "top_k",
     "top_k must be an int >= 0 (0: no top-k) or null, got -3"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "seed": "abc"}, "seed", "seed must be an int or null, got 'abc'"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "min_p": 1.5}, "min_p", "min_p must be a number in [0, 1] (0: off), got 1.5"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "temperature": None}, "temperature",
     "temperature must be 0 (greedy) or a number in [0.0001, 100.0], got None"),
    (abi.PRED, {"kv": 0, "n_tokens": 1, "output": "logits", "top_p": 1.5}, "top_p", "top_p must be a number in (0, 1]"),
    (abi.KV_CREATE, {"path": 7}, "path", "path must be a string path or null, got 7"),
    (abi.KV_CREATE, {"mode": 0o10000}, "mode", "mode must be a permission mode"),
    (abi.KV_OPEN, {}, "path", "path is required: path must be a string path"),
    (abi.KV_OPEN, {"path": "/a", "mode": 1}, "mode", "mode must be a string"),
    (abi.KV_TRUNCATE, {"kv": 1, "n": -1}, "n", "n must be an int >= 0, got -1"),
    (abi.KV_EXTRACT, {"kv": 1, "ranges": []}, "ranges", "ranges must be a non-empty list"),
    (abi.KV_EXTRACT, {"kv": 1, "ranges": [[1, 2, 3]]}, "ranges", "[start, end) pairs, got [[1, 2, 3]]"),
    (abi.KV_MERGE, {"kvs": []}, "kvs", "kvs must be a non-empty list"),
    (abi.KV_MERGE, {"kvs": ["a"]}, "kvs", "kvs must be"),
    (abi.KV_STAT, {}, "", "stat needs exactly one of kv (a handle) and path"),
    (abi.KV_STAT, {"kv": 1, "path": "/a"}, "", "stat needs exactly one"),
    (abi.KV_ADVISE, {"kv": 1, "hint": 3}, "hint", "hint must be a string"),
    (abi.KV_RENAME, {"old": "/a"}, "new", "new is required"),
    (abi.SEND, {}, "data", "data is required"),
    (abi.WRITE_STREAM, {"stream": "stdin", "data": "x"}, "stream", "stream must be 'stdout' or 'stderr', got 'stdin'"),
    (abi.WRITE_STREAM, {"stream": "stdout", "data": 5}, "data", "data must be a string, got 5"),
    (abi.FETCH, {"id": 0, "offset": 0}, "id", "id must be an int in [1, "),
    (abi.FETCH, {"id": 1, "offset": -1}, "offset", "offset must be an int in [0, "),
    (abi.CAP_HTTP, {"url": "u", "headers": ["a"]}, "headers", "headers must be an object"),
    (abi.CAP_READ_FILE, {"path": None}, "path", "path must be a string path, got None"),
    (abi.CAP_LIST_DIR, {}, "path", "path is required"),
]


def _decode(op, body):
    return schema.decode(op, orjson.dumps(body))


def test_every_op_has_one_type_and_one_handler():
    from symphony.kernel.syscall.calls import PARTS, handled_ops
    assert set(schema.REQUESTS) == set(abi.OP_NAMES) == set(GOOD)
    assert set(handled_ops()) == set(abi.OP_NAMES)                  # no op without a handler, none twice
    for part in PARTS:                                              # and every handler a method of its part
        assert all(callable(getattr(part, name, None)) for name in part.OPS.values()), part


@pytest.mark.parametrize("op", sorted(GOOD), ids=lambda op: abi.OP_NAMES[op])
def test_a_good_body_decodes_the_same_on_both_sides(op):
    got = _decode(op, GOOD[op])
    assert isinstance(got, schema.REQUESTS[op])
    built = schema.build(op, **GOOD[op])
    assert built == got
    assert schema.decode(op, schema.encode(built)) == got           # what the LIP sends, the kernel reads
    for name, value in GOOD[op].items():
        want = [list(r) for r in getattr(got, name)] if name == "ranges" else getattr(got, name)
        assert want == value, name


def test_defaults_and_the_empty_body():
    assert schema.decode(abi.NOP, b"") == schema.Empty()
    p = _decode(abi.PRED, {"kv": 0, "n_tokens": 1})
    assert (p.output, p.k, p.all_logits, p.positions, p.n_mask_words, p.sampling) == \
        ("logits", 20, False, None, 0, (1.0, 1.0, 0, None, 0.0))
    assert schema.encode(schema.build(abi.PRED, kv=0, n_tokens=1)) == b'{"kv":0,"n_tokens":1}'   # defaults omitted
    assert _decode(abi.PRED, {"kv": 0, "n_tokens": 1, "output": "sample", "temperature": 0}).temperature == 0
    with pytest.raises(schema.SchemaError, match="temperature must be"):   # the bounds bind every pred
        _decode(abi.PRED, {"kv": 0, "n_tokens": 1, "output": "logits", "temperature": 500.0})


@pytest.mark.parametrize("op,body,field,words", BAD, ids=[f"{abi.OP_NAMES[b[0]]}-{b[2] or 'body'}-{i}"
                                                         for i, b in enumerate(BAD)])
def test_a_bad_body_is_refused_naming_the_field_on_both_sides(op, body, field, words):
    with pytest.raises(schema.SchemaError) as kernel_side:
        _decode(op, body)
    assert not isinstance(kernel_side.value, schema.Undecodable)
    assert kernel_side.value.field == field and words in str(kernel_side.value), str(kernel_side.value)
    with pytest.raises(schema.SchemaError) as lip_side:
        schema.build(op, **body)
    assert str(lip_side.value) == str(kernel_side.value)


def test_unknown_and_huge_fields_are_refused_without_quoting_them():
    huge = "x" * 60_000
    for op in GOOD:
        with pytest.raises(schema.SchemaError, match="unknown field 'pad' in a") as e:
            _decode(op, {**GOOD[op], "pad": huge})
        assert len(str(e.value)) < 400
        with pytest.raises(schema.SchemaError, match="unknown field") as e:
            _decode(op, {**GOOD[op], huge: 1})                        # a huge name is cut
        assert len(str(e.value)) < 400 and e.value.field == "x" * 64


def test_not_an_object_and_not_json():
    for raw in (b"[1, 2]", b'"s"', b"3", b"null"):
        with pytest.raises(schema.SchemaError, match="a system call body must be a JSON object") as e:
            schema.decode(abi.KV_LIST, raw)
        assert not isinstance(e.value, schema.Undecodable)
    for raw in (b"{", b"\xff\xfe", b'{"path": "/"} trailing', b"{'path': '/'}"):
        with pytest.raises(schema.Undecodable, match="malformed JSON body"):
            schema.decode(abi.KV_LIST, raw)
    deep = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"             # a JSON value nested too deeply
    with pytest.raises(schema.Undecodable, match="nested too deeply"):
        schema.decode(abi.SEND, deep)
    with pytest.raises(schema.UnknownOp, match="unknown system call 99"):
        schema.decode(99, b"{}")
    with pytest.raises(schema.Undecodable):                              # not JSON: a strike, whatever the op
        schema.decode(99, b"{")


def test_lip_side_refuses_python_values_json_cannot_carry():
    with pytest.raises(schema.SchemaError, match="temperature must be 0 .greedy. or a number in .*got nan"):
        schema.build(abi.PRED, kv=0, n_tokens=1, temperature=float("nan"))
    with pytest.raises(schema.SchemaError, match="temperature must be 0 .greedy. or a number in .*got inf"):
        schema.build(abi.PRED, kv=0, n_tokens=1, output="sample", temperature=float("inf"))
    with pytest.raises(schema.SchemaError, match="k must be an int in .1, 1024., got np.int64.5."):
        schema.build(abi.PRED, kv=0, n_tokens=1, k=np.int64(5))


def test_the_lip_library_builds_bodies_with_the_schema_and_raises_invalid_argument(ring):
    """A bad argument is refused in the LIP (InvalidArgument): nothing reaches the kernel's side of
    the ring; a good call crosses it as the schema encodes it."""
    from modelfiles import tiny_tokenizer
    from symphony.lip import KVFile, errors, pred, runtime
    k, lip = ring
    runtime.attach(lip, tiny_tokenizer())
    try:
        f = KVFile(4, None, True)
        with pytest.raises(errors.InvalidArgument, match="top_p must be a number in \\(0, 1\\], got 0") as e:
            pred(f, [1, 2], output="sample", top_p=0)
        assert e.value.code == "EINVAL"
        with pytest.raises(errors.InvalidArgument, match="n_tokens must be an int in \\[1, 8192\\], got 0"):
            pred(f, [])
        with pytest.raises(errors.InvalidArgument, match="ranges must be a non-empty list"):
            f.extract([])
        assert not k.pending() and k.taken == 0                              # none crossed the ring
        sent = []

        def answer(k, slot, req):
            sent.append((req.op, req.json))
            k.respond(slot, req.call_id, abi.OK, b'{"length":1}')
        t = _serve_one(k, answer)
        f.truncate(1)                                                        # a good call does
        t.join()
        assert sent == [(abi.KV_TRUNCATE, b'{"kv":4,"n":1}')] and len(f) == 1
    finally:
        runtime.detach()
    with pytest.raises(errors.NotInLIP):
        f.truncate(1)


# ---------------------------------------------------------------- arenas: declared once, top-k round trip
def _assigned(path: Path) -> set[str]:
    """The names ``path`` assigns anywhere (``X = ...``, ``X, Y = ...``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            names.update(e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts
                         if isinstance(e, ast.Name))
    return names


def test_arena_kinds_are_declared_once_in_abi():
    kinds = {abi.ARENA_NONE, abi.ARENA_F32, abi.ARENA_I32, abi.ARENA_TOPK}
    assert len(kinds) == 4 and abi.ARENA_LOGITS == abi.ARENA_F32
    assert set(layout.ARENA_DTYPES) == set(abi.ARENA_DTYPES) == kinds - {abi.ARENA_NONE}
    for path in (REPO / "symphony").rglob("*.py"):                      # nobody else assigns an ARENA_ name
        if path.name != "abi.py":
            assert not [n for n in _assigned(path) if n.startswith("ARENA_") and n != "ARENA_DTYPES"], path


def test_abi_constants_are_declared_again_only_in_the_engine_and_equal():
    """abi.py is the one home of the ABI's numbers.  Only the engine, which may import nothing of
    ipc (tests/test_layout.py), declares some of them again (the sampler's temperature bounds); each
    copy must hold the ABI's value (a tuple: the same members)."""
    import importlib
    consts = {n for n in vars(abi) if n.isupper()}
    copies = {}
    for path in sorted((REPO / "symphony").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("symphony/ipc/") and (names := _assigned(path) & consts):
            copies[rel] = names
    assert all(rel.startswith("symphony/engine/") for rel in copies), copies
    assert copies["symphony/engine/sampler.py"] == {"MIN_TEMPERATURE", "MAX_TEMPERATURE"}   # the check sees them
    for rel, names in copies.items():
        mod = importlib.import_module(rel[:-3].replace("/", "."))
        for n in names:
            mine, ours = getattr(mod, n), getattr(abi, n)
            assert (set(mine) == set(ours) if isinstance(ours, tuple) else mine == ours), (rel, n, mine, ours)


@pytest.fixture
def ring():
    k = KernelSide.create(f"symtest{secrets.token_hex(3)}", n_slots=2, slot_bytes=4096, arena_bytes=4096)
    lip = LipSide.attach(k.names, spin_us=0)
    yield k, lip
    lip.close()
    k.close()
    k.unlink()


def _serve_one(k, write):
    import threading

    def serve():
        for _ in range(2000):
            slots = k.poll()
            if slots:
                req = k.read_request(slots[0])
                write(k, slots[0], req)
                return
            threading.Event().wait(0.001)
    t = threading.Thread(target=serve)
    t.start()
    return t


def test_a_topk_reply_arrives_as_ids_and_logprobs(ring):
    k, lip = ring
    rows, kk = 3, 5
    ids = np.arange(rows * kk, dtype=np.int32).reshape(rows, kk) * 1000 + 7         # [rows, k]
    lp = -np.linspace(0.1, 9.0, rows * kk, dtype=np.float32).reshape(rows, kk)     # [rows, k]

    def write(k, slot, req):                        # as the kernel's pred delivery writes it
        view = k.arena(slot, 2 * rows, kk)          # float32 [2*rows, k]
        view[:rows] = ids.view(np.float32)
        view[rows:] = lp
        k.respond(slot, req.call_id, abi.OK, b"{}", abi.ARENA_TOPK, 2 * rows, kk)
    t = _serve_one(k, write)
    r = lip.call(abi.PRED, b"{}", None, timeout=10)
    t.join()
    assert isinstance(r.arena, layout.TopK)
    assert r.arena.ids.dtype == np.int32 and r.arena.logprobs.dtype == np.float32
    np.testing.assert_array_equal(r.arena.ids, ids)            # exact: the bits are not reinterpreted
    np.testing.assert_array_equal(r.arena.logprobs, lp)
    assert not r.arena.ids.flags.writeable and np.shares_memory(r.arena.ids, np.frombuffer(lip.buffer, np.uint8))


def test_topk_arena_writes_what_the_lip_reads(ring):
    k, lip = ring
    ids = np.array([[5, 9], [2, 0]], dtype=np.int32)                 # [rows, k]
    lp = np.array([[-0.5, -1.5], [-0.25, -3.0]], dtype=np.float32)   # [rows, k]

    def write(k, slot, req):
        view = k.topk_arena(slot, 2, 2)
        view.ids[:] = ids
        view.logprobs[:] = lp
        k.respond(slot, req.call_id, abi.OK, b"", abi.ARENA_TOPK, 4, 2)
    t = _serve_one(k, write)
    r = lip.call(abi.PRED, b"", None, timeout=10)
    t.join()
    np.testing.assert_array_equal(r.arena.ids, ids)
    np.testing.assert_array_equal(r.arena.logprobs, lp)
    with pytest.raises(ValueError, match="needs"):
        k.topk_arena(0, 300, 2)                                      # 4800 bytes > the 4096-byte arena


def test_logits_and_int32_arenas_keep_their_types(ring):
    k, lip = ring
    for kind, dt in ((abi.ARENA_LOGITS, np.float32), (abi.ARENA_I32, np.int32)):
        def write(k, slot, req, kind=kind, dt=dt):
            k.arena(slot, 2, 3, dt)[:] = np.arange(6).reshape(2, 3)
            k.respond(slot, req.call_id, abi.OK, b"", kind, 2, 3)
        t = _serve_one(k, write)
        r = lip.call(abi.NOP, b"", None, timeout=10)
        t.join()
        assert r.arena.dtype == dt and r.arena.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_topk_arena_with_odd_rows_is_a_ring_error(ring):
    k, lip = ring

    def write(k, slot, req):
        k.respond(slot, req.call_id, abi.OK, b"", abi.ARENA_TOPK, 3, 2)
    t = _serve_one(k, write)
    with pytest.raises(layout.RingError, match="even number of rows"):
        lip.call(abi.NOP, b"", None, timeout=10)
    t.join()
    with pytest.raises(ValueError, match="unknown arena_kind 9"):
        k.respond(0, 1, abi.OK, b"", 9, 1, 1)

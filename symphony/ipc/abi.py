"""The system-call ABI shared by the kernel and the LIP library, declared once.

A call is (op, JSON body, int32 token array); a reply is (status, JSON body,
optional arena array).  Status 0 is success; 2 (CHUNKED) says the successful
reply is too large for a slot and must be fetched in chunks (op FETCH);
otherwise the body is
``{"error": CODE, "type": NAME, "message": TEXT}`` and the LIP library raises
the exception class of that NAME (see `symphony.lip.errors`).

Each op's request body is a declared type in `symphony.ipc.schema` (decoded
and validated there, on both sides); the ring that carries calls is
`symphony.ipc.layout` (+ kernel_side, lip_side, wait).  Everything below is the
one place these numbers live: every other module imports them from here, except
the engine, which imports nothing of ipc: the copies it keeps are tied to these
by tests/test_ipc_schema.py.
"""
from __future__ import annotations

# ---- ops
NOP = 0
PRED = 1
KV_CREATE, KV_OPEN, KV_CLOSE, KV_REMOVE, KV_FORK, KV_TRUNCATE = 2, 3, 4, 5, 6, 7
KV_EXTRACT, KV_MERGE, KV_STAT, KV_LIST, KV_ADVISE, KV_RENAME, KV_SYNC, KV_MKDIR, KV_RMDIR = \
    8, 9, 10, 11, 12, 13, 14, 15, 16
KV_LOOKUP, KV_PUBLISH = 17, 18   # chain files: block-keyed prefix caching (kvfs/chains.py)
SEND, RECV, WRITE_STREAM = 20, 21, 22
CAP_HTTP, CAP_READ_FILE, CAP_LIST_DIR = 30, 31, 32
INFO = 40
FETCH = 41            # the next chunk of a reply too large for a slot (see kernel/syscall/replies.py)

OP_NAMES = {v: k for k, v in dict(globals()).items() if k.isupper() and isinstance(v, int)}

# ---- reply status
OK = 0
ERR = 1
CHUNKED = 2           # body {"chunked": id, "size": n}: FETCH the n bytes of the real (OK) reply

# ---- arena kinds: what the response header's arena_kind says the slot's arena region holds
ARENA_NONE = 0        # no arena
ARENA_F32 = 1         # float32 [rows, cols]
ARENA_I32 = 2         # int32 [rows, cols]
ARENA_TOPK = 3        # a top-k reply, [2*r, k] 32-bit words: rows [0, r) int32 token ids,
                      # rows [r, 2r) float32 log-probs; the LIP side splits it into (ids, logprobs)
ARENA_LOGITS = ARENA_F32          # a logits reply: float32 [rows, vocab]
ARENA_DTYPES = {ARENA_F32: "<f4", ARENA_I32: "<i4", ARENA_TOPK: "<i4"}   # element type (4 bytes each)

# ---- pred output modes
OUTPUTS = ("logits", "topk", "sample", "argmax")

# ---- limits a call's body is checked against (by its schema, symphony.ipc.schema)
MAX_TOKENS_PER_CALL = 8192
MAX_TOP_K = 1024                  # k of a pred(output="topk")
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0   # a sampling temperature: 0 (greedy) or in this range
MAX_MASK_WORDS = 1 << 20          # a token mask's uint32 words (the kernel wants exactly ceil(vocab/32))
MAX_ID = (1 << 63) - 1            # a FETCH's reply id and byte offset are ints up to this
MAX_LIST_ITEMS = 1 << 16          # ranges of an extract, files of a merge
KEY_WORDS = 4                     # a chain key: 16 bytes, 4 int32 words of the call's array
MAX_KEYS_PER_CALL = MAX_TOKENS_PER_CALL // KEY_WORDS
MAX_BLOCK = 4096                  # tokens of a chain file's block
MAX_LOOKUP_WAIT_S = 300.0         # the longest a lookup may wait for promised blocks
MAX_TRUST = 256                   # users a lookup trusts besides its own
MAX_LOGIT_BIAS = 1024             # (token id, bias) pairs of a pred's logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0      # |bias| at most this (OpenAI's range: a bias of +-100 forces or bans a token)

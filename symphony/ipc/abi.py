"""The system-call ABI shared by the kernel and the LIP library.

A call is (op, JSON body, int32 token array); a reply is (status, JSON body,
optional arena array).  Status 0 is success; 2 (CHUNKED) says the successful
reply is too large for a slot and must be fetched in chunks (op FETCH);
otherwise the body is
``{"error": CODE, "type": NAME, "message": TEXT}`` and the LIP library raises
the exception class of that NAME (see `symphony.lip.errors`).
"""
from __future__ import annotations

# ---- ops
NOP = 0
PRED = 1
KV_CREATE, KV_OPEN, KV_CLOSE, KV_REMOVE, KV_FORK, KV_TRUNCATE = 2, 3, 4, 5, 6, 7
KV_EXTRACT, KV_MERGE, KV_STAT, KV_LIST, KV_ADVISE, KV_RENAME, KV_SYNC, KV_MKDIR, KV_RMDIR = \
    8, 9, 10, 11, 12, 13, 14, 15, 16
SEND, RECV, WRITE_STREAM = 20, 21, 22
CAP_HTTP, CAP_READ_FILE, CAP_LIST_DIR = 30, 31, 32
INFO = 40
FETCH = 41            # the next chunk of a reply too large for a slot (see kernel/replies.py)

OP_NAMES = {v: k for k, v in dict(globals()).items() if k.isupper() and isinstance(v, int)}

# ---- reply status
OK = 0
ERR = 1
CHUNKED = 2           # body {"chunked": id, "size": n}: FETCH the n bytes of the real (OK) reply

# ---- arena kinds of a pred reply
ARENA_NONE, ARENA_LOGITS, ARENA_TOPK = 0, 1, 2

# ---- pred output modes
OUTPUTS = ("logits", "topk", "sample", "argmax")

MAX_TOKENS_PER_CALL = 8192

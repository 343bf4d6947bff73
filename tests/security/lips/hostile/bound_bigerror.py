"""Provokes error messages larger than a ring slot: a 30 KB path outside its
grants (on 04f0b73 the message quoted it whole; now the capability layer may
refuse an over-long path without quoting it, or quote it truncated), and a pred() whose bad n_tokens the kernel
quotes with repr() (20000 zero-width spaces: 60 KB of request, 120 KB of
message).  On 04f0b73 the second killed the syscall thread: every LIP hung."""
from symphony.ipc import abi
from symphony.lip import read_file, send
from symphony.lip.errors import InvalidArgument, PermissionDenied
from symphony.lip.runtime import _call


def main(n="30000"):
    path = "/nowhere/" + "x" * int(n)
    try:
        read_file(path)
        send("read: no error\n")
    except (PermissionDenied, InvalidArgument) as e:
        msg = str(e)
        send(f"PermissionDenied {len(msg)} truncated={'[truncated' in msg} starts={msg[:12]!r}\n")
    try:
        _call(abi.PRED, {"kv": 0, "n_tokens": "\u200b" * 20000})
        send("pred: no error\n")
    except InvalidArgument as e:
        msg = str(e)
        send(f"InvalidArgument {len(msg)} truncated={'[truncated' in msg} starts={msg[:12]!r}\n")

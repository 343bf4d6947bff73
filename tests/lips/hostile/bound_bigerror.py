"""Asks for a 30 KB path outside its grants: the kernel's error message quotes
it.  On 04f0b73 that reply did not fit a ring slot and killed the syscall thread."""
from symphony.lip import read_file, send
from symphony.lip.errors import PermissionDenied


def main(n="30000"):
    path = "/nowhere/" + "x" * int(n)
    try:
        read_file(path)
        send("read: no error\n")
    except PermissionDenied as e:
        msg = str(e)
        send(f"PermissionDenied {len(msg)} truncated={'[truncated' in msg} starts={msg[:12]!r}\n")

"""Exercises bad system calls; sends the exception type of each."""
from symphony.lip import kv, pred, http, read_file, send, errors


def attempt(name, fn):
    try:
        fn()
        send(f"{name}: no error\n")
    except errors.SyscallError as e:
        send(f"{name}: {type(e).__name__} {e.code}\n")


def main():
    f = kv.create()
    attempt("open missing", lambda: kv.open("/shared/definitely-missing.kv"))
    attempt("token out of range", lambda: pred(f, [10 ** 7]))
    attempt("empty tokens", lambda: pred(f, []))
    attempt("position past context", lambda: pred(f, [1], positions=[10 ** 6]))
    attempt("bad handle", lambda: pred(_fake(), [1]))
    attempt("bad path", lambda: kv.create("/etc/passwd.kv"))
    attempt("http not granted", lambda: http("http://example.com/"))
    attempt("read not granted", lambda: read_file("/etc/hostname"))
    attempt("huge all_logits", lambda: pred(f, list(range(1, 200)), all_logits=True))
    g = kv.create("/tmp/errors-ro.kv")
    g.close()
    r = kv.open("/tmp/errors-ro.kv", "r")
    attempt("write read-only", lambda: pred(r, [1]))
    r.close()
    kv.remove("/tmp/errors-ro.kv")
    send("done\n")


def _fake():
    from symphony.lip import KVFile
    return KVFile(987654, None, True)

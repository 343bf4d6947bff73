"""Tries to signal other processes: kill() and the fcntl(F_SETOWN) + F_SETSIG + O_ASYNC
route (a pipe that, once written, has the kernel deliver a signal to its "owner").

Arguments: name=pid pairs.  Reports one line per attempt: "<name> <how> refused|DONE"."""
import ctypes
import os
import signal

from symphony.lip import send

F_SETOWN, F_SETSIG, F_GETFL, F_SETFL, O_ASYNC = 8, 10, 3, 4, 0o20000


def via_fcntl(pid: int, sig: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    try:
        if libc.fcntl(r, F_SETOWN, pid) != 0:
            return "refused"
        if libc.fcntl(r, F_SETSIG, sig) != 0:
            return "refused"
        fl = libc.fcntl(r, F_GETFL, 0)
        if fl < 0 or libc.fcntl(r, F_SETFL, fl | O_ASYNC) != 0:
            return "refused"
        os.write(w, b"x")                   # the kernel now signals the pipe's owner
        return "DONE"
    finally:
        os.close(r)
        os.close(w)


def main(*targets):
    for t in targets:
        name, pid = t.split("=")
        pid = int(pid)
        for how, sig in (("kill-STOP", signal.SIGSTOP), ("kill-KILL", signal.SIGKILL)):
            try:
                os.kill(pid, sig)
                res = "DONE"
            except OSError:
                res = "refused"
            send(f"{name} {how} {res}\n")
        for how, sig in (("fcntl-STOP", signal.SIGSTOP), ("fcntl-KILL", signal.SIGKILL)):
            try:
                res = via_fcntl(pid, sig)
            except OSError:
                res = "refused"
            send(f"{name} {how} {res}\n")

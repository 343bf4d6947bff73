"""Makes the same http call from N threads at once and reports each outcome:
a redirect to an ungranted host, or a flood of slow calls meant to take every
capability worker."""
import threading
import time

from symphony.lip import errors, http, send


def main(url, n="1", timeout="20"):
    got = []

    def one():
        t0 = time.monotonic()
        try:
            r = http(url, timeout=float(timeout))
            got.append({"status": r["status"], "body": r["body"][:40], "s": round(time.monotonic() - t0, 2)})
        except errors.SyscallError as e:
            got.append({"error": type(e).__name__, "message": str(e)[:200]})
    ts = [threading.Thread(target=one) for _ in range(int(n))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    send({"got": got})

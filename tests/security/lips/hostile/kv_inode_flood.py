"""Creates empty named KV files as fast as it can (85,000 of them), then
removes what it made."""
from symphony.lip import SyscallError, QuotaExceeded, info, kv, send


def main(n="85000"):
    d = f"/home/{info()['user']}/flood"
    kv.mkdir(d)
    made = 0
    try:
        for made in range(int(n)):
            kv.create(f"{d}/{made}").close()
        made = int(n)
        send(f"created {made} files, nobody stopped me\n")
    except QuotaExceeded as e:
        send(f"inode quota stopped me after {made} files: {e}\n")
    except SyscallError as e:
        send(f"stopped after {made} files by {type(e).__name__}: {e}\n")
    for i in range(made):
        kv.remove(f"{d}/{i}")
    kv.rmdir(d)
    send("cleaned up\n")

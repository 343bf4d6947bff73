"""send()s a lot of output (default 200 MB in 60 KB messages) to a client that
may never read it.  On 04f0b73 the kernel buffered all of it."""
from symphony.lip import send


def main(mb="200"):
    chunk = "y" * 60000
    n = int(mb) * 1000000 // len(chunk)
    for i in range(n):
        send(chunk)
    send(f"done {n}\n")

"""Reads a large file and lists a large directory in its granted directory: the
replies are far larger than a ring slot.  On 04f0b73 the LIP waited forever."""
import hashlib

from symphony.lip import list_dir, read_file, send


def main(path, listing):
    data = read_file(path)
    send(f"read {len(data)} {hashlib.sha256(data.encode()).hexdigest()}\n")
    names = list_dir(listing)
    send(f"listed {len(names)} {hashlib.sha256(chr(10).join(names).encode()).hexdigest()}\n")

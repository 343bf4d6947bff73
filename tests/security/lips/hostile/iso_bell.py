"""Rings its doorbell as fast as it can without making calls; every ``every``
rings it makes one real call (NOP), so that its bell is not muted for silence
alone.  Runs until killed."""
import os

from symphony.lip import runtime
from symphony.ipc import abi


def main(every="16"):
    bell = runtime._ring._bell
    n, every = 0, int(every)
    while True:
        os.eventfd_write(bell, 1)
        n += 1
        if every and n % every == 0:
            runtime._call(abi.NOP)

"""The LIP worker sandbox: rlimits, capabilities dropped, identity, and the seccomp allow list.

    lockdown.py       the lockdown sequence a worker runs before user code
                      (fds, rlimits, identity, capabilities, seccomp) and its policy
    bpf.py            the seccomp-bpf filter compiled from the table
    seccomp_table.py  the table: syscall numbers, the allow list, argument rules
"""


class SandboxError(Exception):
    """The sandbox could not be set up; the worker must not run user code."""

"""The one error a system call is answered with.

Raised anywhere on the kernel side of a call (the syscall layer, the
capabilities); the syscall thread turns it into the reply
``{"error": code, "type": type, "message": message}``, which the LIP library
raises as the ``symphony.lip.errors`` class named ``type``."""
from __future__ import annotations


class SyscallFailure(Exception):
    """A system call failed; ``type``/``code`` name the error the LIP sees."""

    def __init__(self, type_: str, code: str, message: str):
        super().__init__(message)
        self.type, self.code = type_, code


def fail(type_: str, code: str, message: str):
    """Fail the current system call with ``type_`` / ``code`` and ``message``."""
    raise SyscallFailure(type_, code, message)

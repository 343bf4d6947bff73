"""Exceptions a system call raises in a LIP.  The kernel replies with a type
name; the library raises the class of that name (all are `SyscallError`)."""
from __future__ import annotations


class SyscallError(Exception):
    """A system call failed; ``code`` is an errno-style string such as 'ENOENT'."""

    def __init__(self, message: str = "", code: str = "EIO"):
        super().__init__(message)
        self.code = code


class NotFound(SyscallError): pass
class AlreadyExists(SyscallError): pass
class PermissionDenied(SyscallError): pass
class NotADirectory(SyscallError): pass
class IsADirectory(SyscallError): pass
class DirectoryNotEmpty(SyscallError): pass
class BadHandle(SyscallError): pass
class ReadOnlyHandle(SyscallError): pass
class InvalidPath(SyscallError): pass
class InvalidArgument(SyscallError): pass
class QuotaExceeded(SyscallError): pass
class NoSpace(SyscallError): pass
class CorruptFile(SyscallError): pass
class PredError(InvalidArgument): pass
class CapabilityError(SyscallError): pass
class TimedOut(CapabilityError): pass
class NotInLIP(RuntimeError):
    """The LIP library was used outside a LIP worker (no kernel to call)."""


BY_NAME = {c.__name__: c for c in (SyscallError, NotFound, AlreadyExists, PermissionDenied,
                                   NotADirectory, IsADirectory, DirectoryNotEmpty, BadHandle,
                                   ReadOnlyHandle, InvalidPath, InvalidArgument, QuotaExceeded,
                                   NoSpace, CorruptFile, PredError, CapabilityError, TimedOut)}

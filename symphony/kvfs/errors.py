"""Typed KVFS errors.  Each carries an errno-style ``code`` that the system-call
layer passes to LIPs, and a message naming the path or handle involved.  An
operation that raises has changed nothing."""
from __future__ import annotations


class KVFSError(Exception):
    code = "EIO"


class NotFound(KVFSError):
    code = "ENOENT"


class AlreadyExists(KVFSError):
    code = "EEXIST"


class PermissionDenied(KVFSError):
    code = "EACCES"


class NotADirectory(KVFSError):
    code = "ENOTDIR"


class IsADirectory(KVFSError):
    code = "EISDIR"


class DirectoryNotEmpty(KVFSError):
    code = "ENOTEMPTY"


class BadHandle(KVFSError):
    """Unknown, closed, or another process's handle."""
    code = "EBADF"


class ReadOnlyHandle(KVFSError):
    """A write (pred, truncate, ...) through a handle opened read-only."""
    code = "EROFS"


class InvalidPath(KVFSError):
    code = "EINVAL"


class InvalidArgument(KVFSError):
    code = "EINVAL"


class QuotaExceeded(KVFSError):
    code = "EDQUOT"


class NoSpace(KVFSError):
    """Every tier (device, host, disk) is full."""
    code = "ENOSPC"


class CorruptFile(KVFSError):
    """A durable file whose content hash, format or model does not match."""
    code = "EBADMSG"

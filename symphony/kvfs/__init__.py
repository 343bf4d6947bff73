"""KVFS: the KV cache as a file system (see fs.py)."""
from .data import KVPred
from .errors import (AlreadyExists, BadHandle, CorruptFile, DirectoryNotEmpty, InvalidArgument,
                     InvalidPath, IsADirectory, KVFSError, NoSpace, NotADirectory, NotFound,
                     PermissionDenied, QuotaExceeded, ReadOnlyHandle)
from .fs import KERNEL, KVFS, KVFSConfig
from .namespace import Principal

__all__ = ["KVFS", "KVFSConfig", "KVPred", "Principal", "KERNEL", "KVFSError", "AlreadyExists",
           "BadHandle", "CorruptFile", "DirectoryNotEmpty", "InvalidArgument", "InvalidPath",
           "IsADirectory", "NoSpace", "NotADirectory", "NotFound", "PermissionDenied",
           "QuotaExceeded", "ReadOnlyHandle"]

"""The ``gguf`` package's file reader, made fast enough to open a model at every start.

``gguf.GGUFReader`` parses every metadata value into numpy views of the file's memory map:
one or two views per element of an array, so a 49,152-token vocabulary with its merges is
~300,000 views and ~4 s on the embedded model's file, at every kernel start and in every
tensor-parallel rank. `Reader` is that reader with three changes, all in how it holds what it
parsed or how fast, not in what it parses:

* its ``data`` is a plain ndarray view of the memory map (numpy's memmap subclass makes each
  slice ~3x dearer; the view keeps the map alive as its base);
* arrays of strings and of fixed-size numbers in a little-endian file are walked with
  ``struct`` over a memoryview, their elements held as memoryview slices (which offer the
  ``tobytes`` / ``tolist`` that ``ReaderField.contents`` calls) instead of numpy views;
* the cyclic garbage collector is paused while it parses.

Everything else (the header, scalar values, tensor infos, tensor data) is the package's own
code. ``tests/unit/engine/test_loader.py`` checks that every field's ``contents()`` and every
tensor equal the stock reader's, so a change of the package's internals shows there. Together:
~0.15 s instead of ~4 s for the embedded model.
"""
from __future__ import annotations

import functools
import gc
import struct
import sys

import numpy as np


@functools.cache
def reader_class():
    """The `Reader` class (built on first use: importing ``gguf`` costs ~0.1 s)."""
    import gguf
    from gguf import GGUFValueType

    string, array = GGUFValueType.STRING, GGUFValueType.ARRAY
    # fixed-size element types: their struct / memoryview format
    fixed = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
             GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
             GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
             GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}

    class Reader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            # ~200,000 small objects at once: the cyclic collector would walk them all, over and
            # over, as they accumulate (3x the parse's own time); none of them form cycles
            was = gc.isenabled()
            gc.disable()
            try:
                super().__init__(*args, **kwargs)
            finally:
                if was:
                    gc.enable()

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, v):
            self._plain = v.view(np.ndarray) if isinstance(v, np.memmap) else v
            self._mv = memoryview(self._plain)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != array or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            mv = self._mv
            itype, n = struct.unpack_from("<IQ", mv, orig_offs)
            if itype != string and itype not in fixed:
                return super()._get_field_parts(orig_offs, raw_type)
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            offs = orig_offs + 12
            types = [GGUFValueType(raw_type)] + ([GGUFValueType(itype)] if n else [])
            if itype == string:                # parts: (length, bytes) per string, as the package's
                unpack = _U64.unpack_from
                add = parts.append
                for _ in range(n):
                    (ln,) = unpack(mv, offs)
                    start = offs + 8
                    offs = start + ln
                    add(mv[offs - ln - 8:start])
                    add(mv[start:offs])
                idxs = list(range(3, 2 + 2 * n, 2))
            else:                              # one part per value, as the package's
                size = struct.calcsize(fixed[GGUFValueType(itype)])
                vals = mv[offs:offs + n * size]
                offs += n * size
                if offs <= len(mv):
                    vals = vals.cast(fixed[GGUFValueType(itype)])
                    parts += [vals[i:i + 1] for i in range(n)]
                idxs = list(range(2, 2 + n))
            if offs > len(mv):
                raise ValueError(f"array of {n} values at offset {orig_offs} runs past the end of the file")
            return offs - orig_offs, parts, idxs, types

    return Reader


_U64 = struct.Struct("<Q")

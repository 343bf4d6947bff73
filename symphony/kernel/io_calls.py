"""The message limits under their older import path (`symphony.kernel.daemon`
reads them here); they live in `calls.messages`, with the calls they bound."""
from __future__ import annotations

from .calls.messages import MAX_MESSAGE_BYTES, MAX_QUEUED_OUTPUT

__all__ = ["MAX_MESSAGE_BYTES", "MAX_QUEUED_OUTPUT"]

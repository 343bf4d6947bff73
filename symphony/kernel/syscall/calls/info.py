"""nop and info: what a LIP may ask about itself and the model."""
from __future__ import annotations

from symphony.ipc import abi


class InfoCalls:
    """The informational calls; given the engine (the model's shape)."""

    OPS = {abi.NOP: "nop", abi.INFO: "info"}
    ANYTIME = set(OPS)          # served while a step is on the device: they touch no KV page

    def __init__(self, engine):
        self.engine = engine

    def nop(self, lip, slot, cid, body, toks):
        return {}

    def info(self, lip, slot, cid, body, toks):
        c = self.engine.model_config
        return {"lip": lip.id, "user": lip.user, "grants": lip.grants, "limits": lip.limits,
                "vocab_size": c.vocab_size, "max_context": c.max_context, "page_size": self.engine.page_size,
                "eos_ids": list(self.engine.tokenizer.eos_ids) if self.engine.tokenizer else []}

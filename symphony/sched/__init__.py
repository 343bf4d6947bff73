"""Schedulers.  Level 2 (`batch.BatchScheduler`): which pending pred() calls
form each forward pass.  Level 1 (`lips`): admission, priorities, and which
LIPs give up device pages first."""
from .batch import BatchScheduler, Call, Step
from .lips import LipView, admit, priority_of, swap_out_order

__all__ = ["BatchScheduler", "Call", "Step", "LipView", "admit", "priority_of", "swap_out_order"]

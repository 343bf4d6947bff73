"""Schedulers.  Level 2 (`batch.BatchScheduler`): which pending pred() calls
form each forward pass.  Level 1 (`lips`, `admission`): the admission queue,
priorities, and which LIPs give up device pages first."""
from .admission import AdmissionLimits, AdmissionQueue, Machine, PeakTable, QueueFull, Waiting
from .batch import BatchScheduler, Call, Step
from .lips import LipView, admit, priority_of, swap_out_order

__all__ = ["AdmissionLimits", "AdmissionQueue", "Machine", "PeakTable", "QueueFull", "Waiting",
           "BatchScheduler", "Call", "Step", "LipView", "admit", "priority_of", "swap_out_order"]

"""Schedulers (level 1: LIPs; level 2: batches of pred() calls).

Empty for now: the engine runs whatever batch it is given (`Engine.pred_batch`);
the token-budget batch scheduler arrives with the scheduling work.
"""

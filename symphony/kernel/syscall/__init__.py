"""The syscall thread: it owns the engine and KVFS, serves every LIP's ring, runs each step (calls/pred.py) and answers."""

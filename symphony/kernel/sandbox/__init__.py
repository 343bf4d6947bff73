"""The LIP worker sandbox: rlimits, capabilities dropped, identity, and the seccomp allow list."""

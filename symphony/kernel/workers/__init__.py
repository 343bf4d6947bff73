"""LIP worker processes: the zygote that forks them and the sandbox each enters before user code runs."""

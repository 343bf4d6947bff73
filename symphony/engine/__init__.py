"""The model engine: configuration, loading, weights, the paged KV pool, the forward pass and its ops.

Imports nothing from the kernel, KVFS or the IPC layer."""

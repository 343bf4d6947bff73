"""The kernel <-> LIP interface: the ABI (ops, status codes, arena kinds), the shared-memory ring, the
client wire protocol.  Imported by both sides; imports neither."""

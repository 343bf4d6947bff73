"""The kernel <-> LIP interface, imported by both sides (imports neither).

    abi          ops, status codes, arena kinds, limits: declared once
    schema       each op's request body as a type, decoded and validated in one place
    layout       the ring's shared-memory layout, slot state machine, records
    wait         doorbells, the kernel's WaitSet, the adaptive spin
    kernel_side  KernelSide: the kernel's end of a LIP's ring (hostile input)
    lip_side     LipSide: the LIP's end of its ring
    protocol     the client <-> kernel frames (not the ring)
"""

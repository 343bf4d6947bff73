"""The HTTP gateway: OpenAI's API and programs over HTTP, in front of one kernel or several.

It does no model work: each OpenAI request is served by a program (the stock
`serve` LIP) a kernel runs for the request's key; see server.py (the
process), app.py (the routes), serving.py (the serve contract), kernel.py
(the link to one kernel), kernels.py and router.py (which kernel serves what).
"""

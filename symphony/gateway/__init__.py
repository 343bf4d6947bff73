"""The HTTP gateway: OpenAI's API and programs over HTTP, in front of one kernel.

It does no model work: each OpenAI request is served by a program (the stock
`serve` LIP) the kernel runs for the request's key; see server.py (the
process), app.py (the routes) and serving.py (the serve contract).
"""

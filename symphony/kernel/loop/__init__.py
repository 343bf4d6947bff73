"""The kernel's event loop (the main thread, asyncio on uvloop): client sessions, the process table, admission, LIP starts and exits, output and input, supervision, the gateway child."""

"""The kernel's supervision of its HTTP gateway process (symphony/kernel/loop/gateway_proc.py)."""
import asyncio
import os
import sys

from symphony.kernel.loop import gateway_proc
from symphony.kernel.loop.gateway_proc import GatewayProcess, restart_delay


def test_restart_delay_doubles_up_to_a_minute():
    assert [restart_delay(n) for n in (1, 2, 3, 4, 6, 7, 20)] == [1, 2, 4, 8, 32, 60, 60]


def test_a_gateway_that_keeps_failing_is_restarted_with_backoff_then_given_up(monkeypatch, caplog):
    delays = []

    def fast(n):
        delays.append(restart_delay(n))
        return 0.01
    monkeypatch.setattr(gateway_proc, "restart_delay", fast)
    monkeypatch.setattr(gateway_proc, "MAX_RESTARTS_PER_MIN", 100)
    monkeypatch.setattr(gateway_proc, "MAX_FAILURES_IN_A_ROW", 4)
    g = GatewayProcess("127.0.0.1:1", "/nonexistent.sock", None, [])
    g.argv = [sys.executable, "-c", "import sys; sys.exit(1)"]      # dies at once, every time

    async def main():
        g.start(dict(os.environ))
        await asyncio.wait_for(g.task, 60)
    caplog.set_level("INFO", logger="symphony.kernel")
    asyncio.run(main())
    assert delays == [1, 2, 4, 8]                     # four restarts, each later than the last
    assert g.failures == 5
    assert "failed 4 times in a row: not restarting it" in caplog.text


def test_a_refused_configuration_is_not_restarted(caplog):
    g = GatewayProcess("127.0.0.1:1", "/nonexistent.sock", None, [])
    g.argv = [sys.executable, "-c", "import sys; sys.exit(2)"]

    async def main():
        g.start(dict(os.environ))
        await asyncio.wait_for(g.task, 30)
    caplog.set_level("INFO", logger="symphony.kernel")
    asyncio.run(main())
    assert "refused its configuration (status 2)" in caplog.text and g.failures == 0

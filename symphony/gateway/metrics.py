"""The gateway's Prometheus metrics (``GET /metrics``), through prometheus-client.

Names follow vLLM's where one fits, with a ``symphony:`` prefix:
request counts by route and status, time to first token, inter-token
latency and end-to-end latency histograms, prompt and generated tokens,
prefix-cache tokens queried and hit, and, read from the kernel's `stats` at
each scrape, LIPs running / queued / suspended, KV pages per tier and
admission waits.  Each gateway has its own registry (tests run several).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("symphony:http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("symphony:time_to_first_token_seconds", "Time from a request's arrival to its "
                              "first generated token", ["route"], buckets=_LATENCY, registry=r)
        self.itl = Histogram("symphony:inter_token_latency_seconds", "Time between two pieces of one "
                             "choice's streamed output", ["route"], buckets=_ITL, registry=r)
        self.e2e = Histogram("symphony:e2e_request_latency_seconds", "Time from a request's arrival to its "
                             "last byte", ["route"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("symphony:prompt_tokens", "Prompt tokens of served requests",
                                     ["route"], registry=r)
        self.generation_tokens = Counter("symphony:generation_tokens", "Tokens generated for served requests",
                                         ["route"], registry=r)
        self.cache_queries = Counter("symphony:prefix_cache_queries", "Prompt tokens looked up in the "
                                     "prefix cache", registry=r)
        self.cache_hits = Counter("symphony:prefix_cache_hits", "Prompt tokens whose KV came from the "
                                  "prefix cache (not computed)", registry=r)
        self.lips_started = Counter("symphony:lips_started", "LIPs the gateway started, by route",
                                    ["route"], registry=r)
        self.rejected = Counter("symphony:requests_rejected", "Requests refused before reaching a "
                                "program, by reason", ["reason"], registry=r)
        self.active = Gauge("symphony:gateway_active_requests", "Requests the gateway is serving now",
                            registry=r)
        g = lambda name, doc, labels=(): Gauge(name, doc, list(labels), registry=r)  # noqa: E731
        self.running = g("symphony:num_requests_running", "LIPs running in the kernel (all clients)")
        self.waiting = g("symphony:num_requests_waiting", "LIPs waiting in the kernel's admission queue")
        self.suspended = g("symphony:num_lips_suspended", "LIPs the memory manager suspended")
        self.kv_pages = g("symphony:kv_pages", "KV pages by tier and state", ("tier", "state"))
        self.admission_waits = g("symphony:admission_waits", "LIPs that had to wait for admission, since start")
        self.kernel_up = g("symphony:kernel_up", "1 if the kernel answered the last scrape")

    def observe_kernel(self, stats: dict | None) -> None:
        """Set the kernel gauges from its `stats` reply (None: it did not answer)."""
        self.kernel_up.set(0 if stats is None else 1)
        if stats is None:
            return
        self.running.set(stats.get("lips", 0))
        self.waiting.set(stats.get("admission_queue", 0))
        self.suspended.set(stats.get("suspended_lips", 0))
        for tier, free, total in (("device", "device_pages_free", "device_pages"),
                                  ("host", "host_slots_free", "host_slots"),
                                  ("disk", "disk_slots_free", "disk_slots")):
            if total in stats:
                self.kv_pages.labels(tier, "free").set(stats.get(free, 0))
                self.kv_pages.labels(tier, "used").set(stats[total] - stats.get(free, 0))
        self.admission_waits.set(stats.get("admission_waits", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

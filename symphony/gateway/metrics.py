"""The gateway's Prometheus metrics (``GET /metrics``), through prometheus-client.

Names follow vLLM's where one fits, with a ``symphony:`` prefix:
request counts by route and status, time to first token, inter-token
latency and end-to-end latency histograms, prompt and generated tokens,
prefix-cache tokens queried and hit, and, read from the kernels' `stats` at
each scrape, LIPs running / queued / suspended, KV pages per tier and
admission waits (summed over the kernels that answer); per kernel (label
``kernel``, its socket): in rotation or not, requests in flight and routed
there (by why), LIPs running and waiting.  Each gateway has its own
registry (tests run several).
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
        self.kernel_up = g("symphony:kernel_up", "Kernels that answered the last scrape")
        self.kernel_live = g("symphony:kernel_live", "1 while a kernel is in the gateway's rotation", ("kernel",))
        self.kernel_in_flight = g("symphony:kernel_requests_in_flight", "Requests the gateway has running on "
                                  "a kernel", ("kernel",))
        self.kernel_running = g("symphony:kernel_lips_running", "LIPs running in a kernel (all clients)",
                                ("kernel",))
        self.kernel_waiting = g("symphony:kernel_lips_waiting", "LIPs waiting in a kernel's admission queue",
                                ("kernel",))
        self.affinity_keys = g("symphony:router_affinity_keys", "Prompt prefixes the router remembers")
        self.routed = Counter("symphony:kernel_requests_routed", "Requests and programs sent to a kernel, by "
                              "why (pinned, affinity, least_loaded)", ["kernel", "reason"], registry=r)

    def observe_kernels(self, kernels, stats: list) -> None:
        """Set the kernel gauges from their `stats` replies (None: that one did
        not answer): the unlabelled ones summed over the kernels that answered,
        the ``kernel``-labelled ones per kernel."""
        up = [st for st in stats if st is not None]
        self.kernel_up.set(len(up))
        for k, st in zip(kernels, stats):
            self.kernel_live.labels(k.socket).set(1 if kernels.table.live[k.index] else 0)
            self.kernel_in_flight.labels(k.socket).set(kernels.table.in_flight[k.index])
            self.kernel_running.labels(k.socket).set(st.get("lips", 0) if st else 0)
            self.kernel_waiting.labels(k.socket).set(st.get("admission_queue", 0) if st else 0)
        self.affinity_keys.set(len(kernels.table.affinity))
        if not up:
            return
        total = lambda name: sum(st.get(name, 0) for st in up)  # noqa: E731
        self.running.set(total("lips"))
        self.waiting.set(total("admission_queue"))
        self.suspended.set(total("suspended_lips"))
        for tier, free, size in (("device", "device_pages_free", "device_pages"),
                                 ("host", "host_slots_free", "host_slots"),
                                 ("disk", "disk_slots_free", "disk_slots")):
            if any(size in st for st in up):
                self.kv_pages.labels(tier, "free").set(total(free))
                self.kv_pages.labels(tier, "used").set(total(size) - total(free))
        self.admission_waits.set(total("admission_waits"))

    def render(self) -> bytes:
        return generate_latest(self.registry)

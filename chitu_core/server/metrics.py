"""Prometheus metrics of one server: request and token counters, latency histograms, engine gauges.

Each app gets its own registry, so several servers (or tests) in one process never collide.
Requests are labelled by route template ("/v1/completions"), never by raw path: every path
no route matches shares the label "other", so no client can make the series grow without bound.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from chitu_core.engine.sequence import RequestMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine's counters at scrape time."""

    def __init__(self, stats, max_pending: int, pending):
        self.stats, self.max_pending, self.pending = stats, max_pending, pending

    def collect(self):
        s = self.stats()
        for name, doc, value in (
            ("chitu_num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("chitu_num_requests_running", "Sequences in the running batch.", s.num_running),
            ("chitu_kv_cache_usage_ratio", "Share of KV-cache blocks in use.", s.kv_usage),
            ("chitu_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.", s.prefix_cache_hit_rate),
            ("chitu_queue_length", "Requests accepted by the server and not finished.", self.pending()),
            ("chitu_queue_capacity", "Requests the server accepts before answering 503.", self.max_pending),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("chitu_num_preemptions", "Sequences preempted for lack of KV blocks.", value=s.num_preemptions)
        yield CounterMetricFamily("chitu_engine_steps", "Engine steps run.", value=s.num_steps)


class ServerMetrics:
    def __init__(self, stats, max_pending: int, pending):
        self.registry = CollectorRegistry()
        self.requests = Counter("chitu_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"], registry=self.registry)
        self.failed = Counter("chitu_requests_failed", "Requests answered with a 5xx status, or whose stream ended in "
                              "an error event, by endpoint.", ["endpoint"], registry=self.registry)
        self.aborted = Counter("chitu_requests_aborted", "Requests whose response never completed (the client left, "
                               "e.g. mid-stream), by endpoint.", ["endpoint"], registry=self.registry)
        self.prompt_tokens = Counter("chitu_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry)
        self.generation_tokens = Counter("chitu_generation_tokens", "Generated tokens.", registry=self.registry)
        self.ttft = Histogram("chitu_time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("chitu_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("chitu_e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("chitu_request_queue_time_seconds", "Arrival to first scheduling.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats, max_pending, pending))

    def count(self, endpoint: str, status: str, failed: bool, aborted: bool) -> None:
        """One HTTP request that ended; one that failed is not also counted as aborted."""
        self.requests.labels(endpoint, status).inc()
        if failed:
            self.failed.labels(endpoint).inc()
        elif aborted:
            self.aborted.labels(endpoint).inc()

    def observe_finished(self, m: RequestMetrics) -> None:
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        for hist, value in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token),
                            (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_label(scope) -> str:
    """The template of the route that handled a request ("/v1/completions", "/static" for a mount),
    or "other" when none matched (a 404)."""
    path = getattr(scope.get("route"), "path", None)
    return "other" if path is None else path or "/"

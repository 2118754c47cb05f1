"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own, labelled by the
decoding method: requests by endpoint and status, the queue, time to first token, tokens per
second, tokens per target call, and the acceptance of drafted tokens by depth (accepted over
drafted, as two counters per depth)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, method: str):
        self.method = method
        self.registry = r = CollectorRegistry()
        self.requests = Counter("speculant_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status", "method"], registry=r)
        self.queue = Gauge("speculant_queue_length", "requests waiting for the decoder", ["method"], registry=r)
        self.running = Gauge("speculant_running", "generations running (0 or 1)", ["method"], registry=r)
        self.ttft = Histogram("speculant_time_to_first_token_seconds", "request arrival to first token",
                              ["method"], buckets=_SECONDS, registry=r)
        self.tokens_per_s = Histogram("speculant_tokens_per_second", "a generation's new tokens per second",
                                      ["method"], buckets=(1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 200), registry=r)
        self.tokens_per_call = Histogram("speculant_tokens_per_target_call",
                                         "a generation's new tokens per target pass", ["method"],
                                         buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0), registry=r)
        self.completion_tokens = Counter("speculant_completion_tokens", "tokens generated", ["method"], registry=r)
        self.prompt_tokens = Counter("speculant_prompt_tokens", "prompt tokens read", ["method"], registry=r)
        self.finished = Counter("speculant_generations", "generations by how they ended",
                                ["method", "finish_reason"], registry=r)
        self.drafted = Counter("speculant_drafted_by_depth", "steps that drafted a token at this depth",
                               ["method", "depth"], registry=r)
        self.accepted = Counter("speculant_accepted_by_depth", "steps whose token at this depth was accepted",
                                ["method", "depth"], registry=r)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status), self.method).inc()

    def set_queue(self, waiting: int, running: int) -> None:
        self.queue.labels(self.method).set(waiting)
        self.running.labels(self.method).set(running)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.method).observe(seconds)

    def generation(self, prompt_tokens: int, new_tokens: int, finish_reason: str, stats) -> None:
        m = self.method
        self.finished.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.completion_tokens.labels(m).inc(new_tokens)
        if stats is None or not stats.target_calls:
            return
        if stats.wall_s > 0:
            self.tokens_per_s.labels(m).observe(stats.new_tokens / stats.wall_s)
        self.tokens_per_call.labels(m).observe(stats.tokens_per_call)
        for depth, (d, a) in enumerate(zip(stats.drafted_by_depth, stats.accepted_by_depth), 1):
            self.drafted.labels(m, str(depth)).inc(d)
            self.accepted.labels(m, str(depth)).inc(a)

    def render(self) -> bytes:
        return generate_latest(self.registry)

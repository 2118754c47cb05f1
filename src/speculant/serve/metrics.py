"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own, labelled by the
decoding method: requests by endpoint and status, the queue, time to first token, tokens per
second, tokens per target call, and the acceptance of drafted tokens by depth (accepted over
drafted, as two counters per depth); prompt tokens read and of them those the prefix cache gave.

The prefix cache's and the KV memory's figures (``MemoryCollector``) are read when ``/metrics``
is scraped, not counted per request: the cache's own counters are the truth, and a gauge of
bytes is only right at the moment it is read. The decoding thread owns the cache; the scrape
reads its integers (and the size of its dict of blocks), never iterates it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MemoryCollector:
    """The prefix cache's and the decoder's KV memory, read at scrape time (module doc): gauges
    ``speculant_prefix_cache_bytes`` (its blocks), ``_budget_bytes`` (``--cache-ram``),
    ``_blocks``, ``speculant_kv_memory_bytes`` (``SpeculativeDecoder.kv_memory_bytes``: every
    target and draft backend's KV slab, idle ones included, plus the prefix cache's blocks), and
    counters ``speculant_prefix_cache_hits_total``, ``_misses_total``, ``_evictions_total``,
    ``speculant_prefix_tokens_reused_total``. Without a prefix cache (``--cache-ram 0``, the
    transformers runtime) its figures are 0."""

    def __init__(self, decoder, method: str):
        self.decoder, self.method = decoder, method

    def collect(self):
        pc = getattr(self.decoder, "prefix_cache", None)
        kv = getattr(self.decoder, "kv_memory_bytes", None)
        figures = [
            (GaugeMetricFamily, "speculant_prefix_cache_bytes", "memory the prefix cache's KV blocks take",
             pc.bytes if pc is not None else 0),
            (GaugeMetricFamily, "speculant_prefix_cache_budget_bytes", "the prefix cache's memory budget (--cache-ram)",
             pc.budget_bytes if pc is not None else 0),
            (GaugeMetricFamily, "speculant_prefix_cache_blocks", "KV blocks in the prefix cache (16 tokens each)",
             len(pc) if pc is not None else 0),
            (GaugeMetricFamily, "speculant_kv_memory_bytes", ("KV memory held: every target and draft backend's "
                                                              "cache slab (idle ones included) plus the prefix "
                                                              "cache's blocks"), kv() if callable(kv) else 0),
            (CounterMetricFamily, "speculant_prefix_cache_hits", "prefills that started from a cached prefix",
             pc.hits if pc is not None else 0),
            (CounterMetricFamily, "speculant_prefix_cache_misses", "prefills that found no cached prefix",
             pc.misses if pc is not None else 0),
            (CounterMetricFamily, "speculant_prefix_cache_evictions", "blocks evicted to stay within the budget",
             pc.evictions if pc is not None else 0),
            (CounterMetricFamily, "speculant_prefix_tokens_reused",
             "prompt tokens copied from the prefix cache instead of prefilled",
             pc.tokens_reused if pc is not None else 0)]
        for family, name, doc, value in figures:
            metric = family(name, doc, labels=["method"])
            metric.add_metric([self.method], value)
            yield metric


class Metrics:
    def __init__(self, method: str, decoder=None):
        self.method = method
        self.registry = r = CollectorRegistry()
        if decoder is not None:
            r.register(MemoryCollector(decoder, method))
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
        self.prompt_cached = Counter("speculant_prompt_tokens_cached", "prompt tokens the prefix cache gave "
                                     "(of speculant_prompt_tokens)", ["method"], registry=r)
        for counter in (self.prompt_tokens, self.prompt_cached, self.completion_tokens):
            counter.labels(method)  # exposed (0) before the first generation
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
        self.prompt_cached.labels(m).inc(getattr(stats, "cached_tokens", 0) if stats is not None else 0)
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

"""Prometheus metrics, one registry per app (so tests can run several apps in one process).

Engine-side numbers (requests, tokens, forwards, KV pages, running / queued) are read from
``engine.get_load()`` at scrape time by a custom collector, so they are exactly the engine's counters and cost
nothing per step. Server-side numbers (HTTP responses by status, rejections, finish reasons, latencies, the tokens
and forwards of the requests served) are kept here; they are updated from the engine's thread when a request
finishes (prometheus-client metrics are thread-safe).

Names follow Prometheus' conventions (``promtool check metrics``; tests/test_serve_lifecycle.py checks them):
counters end in ``_total``, gauges and histograms do not, units are base units (``_seconds``), a pool's size is a
``_capacity`` gauge.

Tokens per forward has one definition, the one of ``meta_info`` and ``dllm-jax eval``: a request's completion
tokens over the forward passes it took part in, summed over the finished requests, i.e. exactly
``dllm_tokens_per_forward = dllm_request_completion_tokens_total / dllm_request_forward_passes_total`` (how many
tokens a denoising forward commits per request: the parallel-decoding figure, whatever the batch size).
``dllm_forward_passes_total`` counts the engine's forward passes, where one batched forward serves every request
in it; ``dllm_generation_tokens_total`` over it is therefore tokens per batched forward, which grows with the batch
and is not called tokens per forward here.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dllm"

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


def snapshot(get_load: Callable[[], dict]) -> dict:
    """``engine.get_load()`` from another thread: the engine's thread may add a counter key while it is copied;
    just try again."""
    for _ in range(10):
        try:
            return dict(get_load())
        except RuntimeError:
            continue
    return dict(get_load())


class EngineCollector:
    """Reads the engine's counters and gauges at scrape time."""

    COUNTERS = (
        ("requests", "requests", "Requests submitted to the engine"),
        ("finished", "requests_finished", "Requests that finished (any reason, aborts included)"),
        ("prompt_tokens", "prompt_tokens", "Prompt tokens of submitted requests"),
        ("cached_tokens", "cached_tokens", "Prompt tokens served from the prefix cache"),
        ("generation_tokens", "generation_tokens", "Tokens generated (committed)"),
        ("prefill_forwards", "prefill_forwards", "Prefill forward passes"),
        ("denoise_forwards", "denoise_forwards", "Denoise forward passes (batched; a sync call counts its steps)"),
        ("denoise_calls", "denoise_calls", "Denoise calls (one per scheduler round with decoding rows)"),
        ("chained_blocks", "chained_blocks", "Blocks a request went on from inside a denoise call (FDFO chaining)"),
        ("retractions", "retractions", "Requests retracted under KV memory pressure"),
    )
    GAUGES = (
        ("running_requests", "num_running_requests", "Requests holding a row"),
        ("queued_requests", "num_queued_requests", "Requests waiting in the engine"),
        ("kv_pages_total", "kv_pages_capacity", "KV pages in the pool"),
        ("kv_pages_used", "kv_pages_used", "KV pages in use (by requests or the prefix cache)"),
        ("kv_pages_free", "kv_pages_free", "Free KV pages"),
        ("kv_pages_cached", "kv_pages_cached", "KV pages held by the prefix cache"),
        ("kv_pages_locked", "kv_pages_locked", "Prefix-cache pages locked by running requests"),
    )

    def __init__(self, get_load: Callable[[], dict]):
        self.get_load = get_load

    def collect(self):
        load = snapshot(self.get_load)
        for key, name, doc in self.COUNTERS:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            c.add_metric([], float(load.get(key, 0)))
            yield c
        forwards = load.get("prefill_forwards", 0) + load.get("denoise_forwards", 0)
        c = CounterMetricFamily(f"{PREFIX}_forward_passes", "Forward passes of the engine (prefill + denoise; one "
                                                           "batched forward serves every request in it)")
        c.add_metric([], float(forwards))
        yield c
        for key, name, doc in self.GAUGES:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], float(load.get(key, 0)))
            yield g
        prompt = load.get("prompt_tokens", 0)
        g = GaugeMetricFamily(f"{PREFIX}_cache_hit_rate", "Cached prompt tokens / prompt tokens, since start")
        g.add_metric([], float(load.get("cached_tokens", 0)) / prompt if prompt else 0.0)
        yield g
        total = load.get("kv_pages_total", 0)
        g = GaugeMetricFamily(f"{PREFIX}_kv_pages_usage", "Fraction of the KV page pool in use")
        g.add_metric([], float(load.get("kv_pages_used", 0)) / total if total else 0.0)
        yield g


class ServerMetrics:
    def __init__(self, get_load: Callable[[], dict], get_inflight: Callable[[], int]):
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(EngineCollector(get_load))
        self.http_responses = Counter(f"{PREFIX}_http_responses", "HTTP responses by endpoint and status",
                                      ["endpoint", "status"], registry=r)
        self.rejected = Counter(f"{PREFIX}_rejected_requests", "Requests refused before the engine, by reason",
                                ["reason"], registry=r)
        self.finished = Counter(f"{PREFIX}_server_requests_finished",
                                "Requests submitted by this server that finished, by finish reason", ["reason"],
                                registry=r)
        self.client_aborts = Counter(f"{PREFIX}_client_disconnects",
                                     "Requests unfinished when their client went away (each is aborted; one that "
                                     "finishes before the abort reaches the engine ends normally)", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_request_completion_tokens",
                                         "Completion tokens of finished requests", registry=r)
        self.request_forwards = Counter(f"{PREFIX}_request_forward_passes",
                                        "Forward passes that served finished requests (per request, summed: a "
                                        "batched forward counts once per request in it)", registry=r)
        tokens_per_forward = Gauge(f"{PREFIX}_tokens_per_forward",
                                   "Tokens per forward of the finished requests: request_completion_tokens_total / "
                                   "request_forward_passes_total (as meta_info and dllm-jax eval)", registry=r)
        tokens_per_forward.set_function(self._tokens_per_forward)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end latency of finished requests",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram(f"{PREFIX}_time_to_first_block_seconds", "Time to the first committed block",
                              buckets=LATENCY_BUCKETS, registry=r)
        inflight = Gauge(f"{PREFIX}_server_inflight_requests",
                         "Requests the server has submitted and not yet seen finish", registry=r)
        inflight.set_function(lambda: float(get_inflight()))
        self._lock = threading.Lock()
        self._tokens = 0  # the two counters' values, for their ratio
        self._forwards = 0

    def _tokens_per_forward(self) -> float:
        with self._lock:
            return self._tokens / self._forwards if self._forwards else 0.0

    def observe_finish(self, meta: dict) -> None:
        """Called once per finished request (on the engine's thread)."""
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        self.finished.labels(reason).inc()
        tokens, forwards = int(meta.get("completion_tokens", 0)), int(meta.get("forward_passes", 0))
        with self._lock:
            self._tokens += tokens
            self._forwards += forwards
        self.completion_tokens.inc(tokens)
        self.request_forwards.inc(forwards)
        if meta.get("e2e_latency") is not None:
            self.e2e.observe(meta["e2e_latency"])
        if meta.get("time_to_first_block") is not None:
            self.ttfb.observe(meta["time_to_first_block"])

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of the server (a private registry; rendered on /metrics)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hybridkv.entrypoints.async_engine import AsyncEngine
from hybridkv.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """Values read from the engine's last published stats snapshot."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator:
        s = self.engine.stats
        yield GaugeMetricFamily(
            "hybridkv_requests_running", "Requests running now", value=s["running"]
        )
        yield GaugeMetricFamily(
            "hybridkv_requests_waiting", "Requests waiting to start", value=s["waiting"]
        )
        pool = GaugeMetricFamily(
            "hybridkv_cache_pages", "Pages of the shared pool by state", labels=["state"]
        )
        for state in ("free", "cached", "in_use"):
            pool.add_metric([state], s["usage"][state])
        yield pool
        yield GaugeMetricFamily(
            "hybridkv_cache_snapshot_pages",
            "Pages holding state snapshots",
            value=s["usage"]["snapshot_pages"],
        )
        groups = GaugeMetricFamily(
            "hybridkv_cache_group_pages",
            "Pages owned by each group",
            labels=["group", "kind", "state"],
        )
        for g in s["groups"]:
            for state in ("in_use", "cached"):
                groups.add_metric([str(g["group"]), str(g["kind"]), state], g[state])
        yield groups
        for name, key, doc in (
            ("prefix_cache_queries", "prefix_queries", "Admissions that looked up the cache"),
            ("prefix_cache_hits", "prefix_hits", "Admissions with a prefix hit"),
            ("prefix_cache_query_tokens", "prefix_query_tokens", "Prompt tokens looked up"),
            ("prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens served by the cache"),
            ("preemptions", "preemptions", "Requests preempted (recomputed later)"),
        ):
            yield CounterMetricFamily(f"hybridkv_{name}", doc, value=s[key])
        spec = s.get("spec_decode")
        if spec is not None:  # speculative decoding is on
            yield from spec.metric_families("hybridkv")


class Metrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "hybridkv_requests", "Requests by final status", ["status"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "hybridkv_prompt_tokens",
            "Prompt tokens of finished or aborted requests",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "hybridkv_generation_tokens", "Generated tokens", registry=self.registry
        )
        self.ttft = Histogram(
            "hybridkv_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "hybridkv_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "hybridkv_request_latency_seconds",
            "Arrival to finish",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        engine.on_finished = self.observe_finished
        engine.on_aborted = self.observe_aborted

    def count_request(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    # Requests by final status: "stop" and "length" (finished), "abort" (the client left),
    # "error" (the engine gave up on it); HTTP errors count as "error_<status>". Observed on
    # the engine thread as requests finish (prometheus_client's metrics are thread-safe).

    def observe_finished(self, out: RequestOutput) -> None:
        self.count_request("error" if out.error is not None else out.finish_reason or "unknown")
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        n = len(out.token_ids)
        self.generation_tokens.inc(n)
        m = out.metrics
        if "first_token_time" in m:
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            self.e2e.observe(m["last_token_time"] - m["arrival_time"])
            if n > 1:
                self.tpot.observe((m["last_token_time"] - m["first_token_time"]) / (n - 1))

    def observe_aborted(self, prompt_tokens: int, generated: int) -> None:
        self.count_request("abort")
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The ingress's merged /metrics (hybridkv.serving.metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.serving.metrics import merge


def _replica_text(stops: int, seconds: list[float]) -> str:
    reg = CollectorRegistry()
    requests = Counter("hybridkv_requests", "Requests by status", ["status"], registry=reg)
    tokens = Counter("hybridkv_tokens", "Tokens", registry=reg)
    ttft = Histogram("hybridkv_ttft_seconds", "TTFT", buckets=(0.1, 1.0), registry=reg)
    requests.labels("stop").inc(stops)
    tokens.inc(7)
    for s in seconds:
        ttft.observe(s)
    return generate_latest(reg).decode()


def test_merge_labels_each_sample_and_keeps_families_together() -> None:
    texts = {"replica-0": _replica_text(3, [0.05]), "replica-1": _replica_text(5, [0.5, 2.0])}
    text = merge(texts, {"replica-0": True, "replica-1": True, "replica-2": False})
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses strictly
    up = {s.labels["replica"]: s.value for s in families["hybridkv_ingress_replica_up"].samples}
    assert up == {"replica-0": 1.0, "replica-1": 1.0, "replica-2": 0.0}
    stops = {
        s.labels["replica"]: s.value
        for s in families["hybridkv_requests"].samples
        if s.name == "hybridkv_requests_total"
    }
    assert stops == {"replica-0": 3.0, "replica-1": 5.0}
    counts = {
        s.labels["replica"]: s.value
        for s in families["hybridkv_ttft_seconds"].samples
        if s.name == "hybridkv_ttft_seconds_count"
    }
    assert counts == {"replica-0": 1.0, "replica-1": 2.0}
    assert text.count("# TYPE hybridkv_requests_total counter") == 1
    # a family's samples are contiguous (the text format requires it)
    names = [line.split("{")[0] for line in text.splitlines() if line.startswith("hybridkv_req")]
    assert names == sorted(names, key=names.index)


def test_merge_of_no_replica_still_parses() -> None:
    text = merge({}, {"replica-0": False})
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families] == ["hybridkv_ingress_replica_up"]

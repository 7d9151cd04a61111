"""The ingress's /metrics: every live replica's Prometheus text merged into one exposition.

Each replica renders its own metrics (`hybridkv.entrypoints.metrics`); the ingress asks all
that are in routing and merges them family by family, each sample labelled with its replica,
so one scrape of the ingress sees the whole deployment (sum by the metric to aggregate):

    # HELP hybridkv_requests_total ...            (once per family)
    # TYPE hybridkv_requests_total counter
    hybridkv_requests_total{replica="replica-0",status="stop"} 12.0
    hybridkv_requests_total{replica="replica-1",status="stop"} 9.0

The text format wants a family's samples together after its TYPE line, so samples are grouped
by the family whose TYPE line they follow in their replica's text, in order of first
appearance. The ingress adds `hybridkv_ingress_replica_up{replica}` (1 in routing, 0 not).
"""

from __future__ import annotations

from collections.abc import Mapping

_UP = "hybridkv_ingress_replica_up"


def _labelled(sample: str, replica: str) -> str:
    """`name{a="b"} 1.0` or `name 1.0` with replica="..." as its first label."""
    label = f'replica="{replica}"'
    name_end = min((i for i in (sample.find("{"), sample.find(" ")) if i >= 0), default=-1)
    if name_end < 0:
        return sample
    if sample[name_end] == "{":
        rest = sample[name_end + 1 :]
        sep = "" if rest.startswith("}") else ","
        return f"{sample[:name_end]}{{{label}{sep}{rest}"
    return f"{sample[:name_end]}{{{label}}}{sample[name_end:]}"


def merge(texts: Mapping[str, str], up: Mapping[str, bool]) -> str:
    """One exposition from each replica's text (`texts`: replica -> text) and the routing state
    of every replica (`up`)."""
    order: list[str] = []  # families in order of first appearance
    heads: dict[str, list[str]] = {}  # family -> its HELP / TYPE lines (the first replica's)
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(maxsplit=3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in heads:
                        order.append(family)
                        heads[family], samples[family] = [], []
                    if not any(h.split(maxsplit=2)[1] == parts[1] for h in heads[family]):
                        heads[family].append(line)
                continue
            if family not in samples:  # a sample before any TYPE line: its own family
                order.append(family)
                heads[family], samples[family] = [], []
            samples[family].append(_labelled(line, replica))
    out = [
        f"# HELP {_UP} Whether the ingress routes to the replica (1) or not (0).",
        f"# TYPE {_UP} gauge",
        *(f'{_UP}{{replica="{r}"}} {1.0 if ok else 0.0}' for r, ok in up.items()),
    ]
    for family in order:
        out += heads[family] + samples[family]
    return "\n".join(out) + "\n"

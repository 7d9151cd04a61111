"""Serving across data-parallel replicas: cache-aware routing (`router.py`)."""

from hybridkv.serving.router import (
    CacheEvent,
    IndexSpec,
    PrefixIndex,
    ReplicaLoad,
    Router,
)

__all__ = ["CacheEvent", "IndexSpec", "PrefixIndex", "ReplicaLoad", "Router"]

"""Shared helpers for cache-manager tests: tiny plans and a driver that follows the protocol."""

from __future__ import annotations

from hybridkv.config import CacheConfig
from hybridkv.core.coordinator import CacheManager, SimpleRequest
from hybridkv.kv.plan import make_plan
from hybridkv.kv.specs import AttentionSpec, CacheLayer, LayerSpec, mamba2_state

STATE = mamba2_state(2, 4, 8, 1, 4, "float32", "float32")  # 544 bytes -> 17 tokens at 32 B
ATTN = AttentionSpec(1, 4, "float32")  # 32 bytes per token per layer


def layers_of(specs: list[LayerSpec]) -> list[CacheLayer]:
    return [CacheLayer(f"layers.{i}.x", i, s) for i, s in enumerate(specs)]


def manager(specs=None, num_pages=40, kernel_block_size=4, **cache) -> CacheManager:
    specs = specs or [STATE, ATTN, STATE]
    cfg = CacheConfig(num_pages=num_pages, kernel_block_size=kernel_block_size, **cache)
    return CacheManager(make_plan(layers_of(specs), cfg), cfg)


def request(rid: str, tokens: list[int]) -> SimpleRequest:
    return SimpleRequest(rid, list(tokens), len(tokens))


def prefill(cm: CacheManager, req: SimpleRequest, chunk: int = 1 << 30) -> int:
    """Admit and prefill a request in chunks that end at snapshot boundaries; returns the hit.
    Asserts that the pool could serve it."""
    hit = cm.lookup(req)
    done = hit.num_tokens
    first = True
    while done < len(req.all_token_ids):
        n = min(chunk, len(req.all_token_ids) - done)
        boundary = cm.next_boundary(req, hit if first else None)
        if boundary is not None and done + n > boundary:
            n = boundary - done
        alloc = cm.allocate(req, n, hit if first else None)
        assert alloc is not None, "pool exhausted in a test that expected room"
        first = False
        done += n
        cm.commit(req, done)
    return hit.num_tokens


def decode(cm: CacheManager, req: SimpleRequest, num_tokens: int, next_token: int = 7) -> None:
    """Generate `num_tokens` tokens: each step computes the last token and appends a new one."""
    for _ in range(num_tokens):
        req.all_token_ids.append(next_token)
        n_computed = cm.num_computed(req)
        assert cm.allocate(req, 1) is not None
        cm.commit(req, n_computed + 1)

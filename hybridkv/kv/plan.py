"""The memory plan (design.md section 3): pure functions from layer specs to a frozen plan.

    A = attention bytes per token per layer      M = state bytes per layer
    align = max(smallest kernel block any attention backend accepts, page_tokens or 16)
    hybrid:  page_tokens = align * ceil(M / (align * A)),  page_bytes = page_tokens * A
    kernel block per attention group: page_tokens if every backend of the group accepts it,
        else the largest declared int that divides page_tokens and every backend accepts
    num_pages = budget // (page_bytes * layers_per_group)

One page is `page_bytes` bytes in each of the `layers_per_group` buffers; page ids are global.
An attention page of `page_tokens` tokens is split into `blocks_per_page` kernel blocks:

    page p:  | kb p*r+0 | kb p*r+1 | ... | kb p*r+r-1 |      r = blocks_per_page
               kernel_block_size tokens each

What a group allocates, its *unit*, follows from the allocation mode (design.md section 5):

    mode    attention group                          state group
    block   a kernel block (unit_tokens = kbs)       a page (one state)
    page    a page (unit_tokens = page_tokens)       a page (one state)

Prefix keys hash blocks of `hash_block_tokens` (the gcd of the attention groups' unit_tokens);
prefix hits are multiples of `hit_tokens` (their lcm), the length every attention group can hold
in whole units.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridkv.config import CacheConfig
from hybridkv.dtypes import dtype_bytes
from hybridkv.kv.specs import (
    AttentionSpec,
    CacheLayer,
    LayerSpec,
    MLASpec,
    StateSpec,
)
from hybridkv.layers.attention.registry import (
    BACKENDS,
    AttentionBackendInfo,
    PlanContext,
    get_backend,
    get_platform,
)

DEFAULT_PAGE_TOKENS = 16
DEFAULT_CONTEXT = PlanContext()
NULL_PAGES = 1  # page 0 is reserved as the null page (design.md 5: skipped positions)
# What a machine of the plan's platform normally has, for plans made without one at hand
# (`hybridkv plan`): the engine passes what its machine really has.
DEFAULT_CAPABILITIES = frozenset({"native", "triton"})
AUTO_BUDGET_BYTES = 4 * 2**30  # the cap of an automatically sized pool
# the most of a budget speculative decoding's state scratch takes (`make_speculative_plan`)
SCRATCH_SHARE = 0.5
PAGE_BYTES_ALIGN = 64  # pure state models: pages start on cache lines
T = TypeVar("T")


class PlanError(ValueError):
    """A memory plan that cannot be made (one-line message naming the value and what is allowed)."""


def pages_to_kernel_blocks(page_ids: Sequence[int], blocks_per_page: int) -> list[int]:
    """Expand page ids to kernel-block ids: p -> p*r .. p*r+r-1 (r = blocks_per_page).

    The one page -> kernel-block expansion: the cache managers call it with their units (pages
    in page mode; kernel blocks, r = 1, in block mode) and the block tables with pages."""
    r = blocks_per_page
    if r == 1:
        return list(page_ids)
    return [p * r + j for p in page_ids for j in range(r)]


@dataclass(frozen=True)
class GroupPlan:
    """Layers with an identical spec that share one block table."""

    group_id: int
    spec: LayerSpec
    layer_names: tuple[str, ...]
    page_tokens: int | None  # tokens per page for attention-like groups; None for state
    kernel_block_size: int | None  # None for state groups (never split)
    backend: str | None  # attention backend, or the state ops chosen (None: plan only)
    padding_bytes: int  # state groups: page bytes the state does not use
    layer_ids: tuple[int, ...] = ()  # decoder layer index of each cache layer
    allocation: str = "block"  # "block" or "page" (CacheConfig.allocation)

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def runner(self) -> str | None:
        """The backend that runs this group: its planned one, or for an MLA backend declared
        for planning only (FlashMLA's block sizes) the implemented one it runs on."""
        if self.is_state or self.backend is None:
            return self.backend
        return get_backend(self.backend).runner

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, StateSpec)

    @property
    def blocks_per_page(self) -> int:
        if self.kernel_block_size is None or self.page_tokens is None:
            return 1
        return self.page_tokens // self.kernel_block_size

    @property
    def blocks_per_unit(self) -> int:
        """Kernel blocks in one unit: 1 in block mode, blocks_per_page in page mode."""
        return 1 if self.allocation == "block" else self.blocks_per_page

    @property
    def units_per_page(self) -> int:
        return self.blocks_per_page // self.blocks_per_unit

    @property
    def unit_tokens(self) -> int | None:
        """Tokens one unit holds (attention groups); None for state groups."""
        if self.kernel_block_size is None:
            return None
        return self.kernel_block_size * self.blocks_per_unit

    @property
    def window(self) -> int | None:
        return getattr(self.spec, "sliding_window", None)


@dataclass(frozen=True)
class MemoryPlan:
    architecture: str
    platform: str
    page_tokens: int
    page_bytes: int
    num_pages: int
    layers_per_group: int
    groups: tuple[GroupPlan, ...]
    attention_bytes_per_token: int
    state_bytes: int
    align: int
    max_model_len: int
    context: PlanContext = DEFAULT_CONTEXT
    allocation: str = "block"
    tensor_parallel_size: int = 1  # the plan is one rank's: its specs are per-rank shards
    # budget bytes outside the pages: speculative decoding's state scratch (`speculation_scratch`)
    # for `scratch_rows` requests drafting at once (`make_speculative_plan`)
    reserved_bytes: int = 0
    scratch_rows: int = 0

    @property
    def is_hybrid(self) -> bool:
        return any(g.is_state for g in self.groups) and any(not g.is_state for g in self.groups)

    @property
    def attention_groups(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if not g.is_state)

    @property
    def state_groups(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if g.is_state)

    @property
    def hash_block_tokens(self) -> int:
        """Tokens per prefix-hash block: the gcd of the attention groups' unit_tokens (a model
        without attention: page_tokens, the block its state snapshots are taken at)."""
        if not self.attention_groups:
            return self.page_tokens
        return math.gcd(*(g.unit_tokens or 0 for g in self.attention_groups))

    @property
    def hit_tokens(self) -> int:
        """Prefix hits are multiples of this: the lcm of the attention groups' unit_tokens (a
        model without attention: page_tokens)."""
        if not self.attention_groups:
            return self.page_tokens
        return math.lcm(*(g.unit_tokens or 1 for g in self.attention_groups))

    @property
    def state_padding_bytes(self) -> int:
        return self.page_bytes - self.state_bytes if self.state_bytes else 0

    @property
    def state_padding_pct(self) -> float:
        return 100.0 * self.state_padding_bytes / self.page_bytes if self.state_bytes else 0.0

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes * self.layers_per_group

    @property
    def usable_pages(self) -> int:
        return self.num_pages - NULL_PAGES

    @property
    def attention_token_capacity(self) -> int | None:
        """Tokens the pool holds for the groups whose cache grows with length (full attention
        and MLA), if every usable page went to them. Never divided by state groups."""
        growing = [g for g in self.attention_groups if g.window is None]
        if not growing:
            return None
        return (self.usable_pages // len(growing)) * self.page_tokens

    def pages_for_one_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Pages one request of `num_tokens` tokens holds at its largest, alone in the pool: a
        running state per state group, the pages of every token per full-attention group, and
        per sliding group those of its window plus one prefill chunk (and one page of slack
        for a window that straddles pages). Snapshots are optional and not counted."""
        pages = 0
        for g in self.groups:
            if g.page_tokens is None:
                pages += 1
            elif g.window is None:
                pages += math.ceil(num_tokens / g.page_tokens)
            else:
                held = min(num_tokens, g.window + max_chunk_tokens)
                pages += math.ceil(held / g.page_tokens) + 1
        return pages

    def max_request_tokens(self, max_chunk_tokens: int) -> int:
        """The longest request (prompt + output tokens) that fits alone into the usable pages,
        at most max_model_len; 0 if not even one token fits."""
        low, high = 0, self.max_model_len
        while low < high:  # the largest fitting length (pages grow with the length)
            mid = (low + high + 1) // 2
            if self.pages_for_one_request(mid, max_chunk_tokens) <= self.usable_pages:
                low = mid
            else:
                high = mid - 1
        return low

    def max_kernel_blocks_per_seq(self, group: GroupPlan) -> int:
        assert group.kernel_block_size is not None
        return math.ceil(self.max_model_len / group.kernel_block_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "platform": self.platform,
            "page_tokens": self.page_tokens,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "layers_per_group": self.layers_per_group,
            "total_bytes": self.total_bytes,
            "attention_bytes_per_token": self.attention_bytes_per_token,
            "state_bytes": self.state_bytes,
            "state_padding_bytes": self.state_padding_bytes,
            "state_padding_pct": round(self.state_padding_pct, 3),
            "attention_token_capacity": self.attention_token_capacity,
            "max_model_len": self.max_model_len,
            "allocation": self.allocation,
            "tensor_parallel_size": self.tensor_parallel_size,
            "reserved_bytes": self.reserved_bytes,
            "scratch_rows": self.scratch_rows,
            "hash_block_tokens": self.hash_block_tokens,
            "hit_tokens": self.hit_tokens,
            "groups": [
                {
                    "group_id": g.group_id,
                    "kind": g.kind,
                    "layers": list(g.layer_names),
                    "layer_ids": list(g.layer_ids),
                    "page_tokens": g.page_tokens,
                    "kernel_block_size": g.kernel_block_size,
                    "blocks_per_page": g.blocks_per_page,
                    "unit_tokens": g.unit_tokens,
                    "blocks_per_unit": g.blocks_per_unit,
                    "backend": g.backend,
                    "runs": g.runner,
                    "padding_bytes": g.padding_bytes,
                    "spec": spec_json(g.spec),
                }
                for g in self.groups
            ],
        }


# ---------------------------------------------------------------------------------------------
# Rules (each a small pure function, tested on its own)
# ---------------------------------------------------------------------------------------------


def _describe(backends: Sequence[AttentionBackendInfo], ctx: PlanContext) -> str:
    return "; ".join(f"{b.name}: {b.sizes_for(ctx).describe()}" for b in backends)


def select_kernel_block_size(
    page_tokens: int,
    backends: Sequence[AttentionBackendInfo],
    head_dim: int,
    ctx: PlanContext = DEFAULT_CONTEXT,
    requested: int | None = None,
) -> int:
    """design.md 3.4: page_tokens if every backend accepts it, else the largest declared int
    dividing page_tokens that every backend accepts; a requested size is validated the same way."""

    def ok(size: int) -> bool:
        return page_tokens % size == 0 and all(b.accepts(size, head_dim, ctx) for b in backends)

    names = ", ".join(b.name for b in backends)
    if requested is not None:
        if page_tokens % requested:
            raise PlanError(
                f"kernel_block_size={requested} does not divide page_tokens="
                f"{page_tokens}; it must divide it exactly"
            )
        if not ok(requested):
            raise PlanError(
                f"kernel_block_size={requested} is not accepted by {names} for head "
                f"dim {head_dim}; accepted: {_describe(backends, ctx)}"
            )
        return requested
    if ok(page_tokens):
        return page_tokens
    declared = sorted({i for b in backends for i in b.sizes_for(ctx).ints}, reverse=True)
    for size in declared:
        if ok(size):
            return size
    raise PlanError(
        f"no kernel block size divides page_tokens={page_tokens} and is accepted by "
        f"every backend of the group for head dim {head_dim} ({_describe(backends, ctx)})"
    )


def layers_per_group_for(bucket_sizes: Sequence[int]) -> int:
    """design.md 3.5: the smallest bucket, or the largest if largest < 1.5 x smallest."""
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < 1.5 * smallest else smallest


def split_bucket(layers: Sequence[T], layers_per_group: int) -> list[tuple[T, ...]]:
    """A bucket of n layers becomes ceil(n / layers_per_group) groups taking layers strided."""
    n_groups = math.ceil(len(layers) / layers_per_group)
    return [tuple(layers[i::n_groups]) for i in range(n_groups)]


def hybrid_page_tokens(state_bytes: int, attention_bytes_per_token: int, align: int) -> int:
    """design.md 3.3: the smallest multiple of `align` whose attention page holds one state."""
    return align * math.ceil(state_bytes / (align * attention_bytes_per_token))


def _bucket(layers: Sequence[CacheLayer]) -> dict[LayerSpec, list[CacheLayer]]:
    buckets: dict[LayerSpec, list[CacheLayer]] = {}
    for layer in layers:
        buckets.setdefault(layer.spec, []).append(layer)
    return buckets


def spec_json(spec: LayerSpec) -> dict[str, Any]:
    """A layer spec as plain JSON values (what `hybridkv plan --json` shows per group)."""
    if isinstance(spec, StateSpec):
        return {
            "kind": spec.kind,
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in spec.tensors
            ],
            "ops": [o.name for o in spec.ops],
        }
    if isinstance(spec, MLASpec):
        return {
            "kind": spec.kind,
            "kv_lora_rank": spec.kv_lora_rank,
            "qk_rope_head_dim": spec.qk_rope_head_dim,
            "dtype": spec.dtype,
        }
    return {
        "kind": spec.kind,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
        "sliding_window": spec.sliding_window,
        "softcap": spec.softcap,
    }


def _group_backends(
    spec: AttentionSpec | MLASpec,
    cache: CacheConfig,
    capabilities: frozenset[str] = DEFAULT_CAPABILITIES,
) -> list[AttentionBackendInfo]:
    platform = get_platform(cache.platform)
    if cache.attention_backend is None:  # the platform's first default that serves the layers
        names = platform.default_backends(spec.kind)
        serving = [n for n in names if _serves(get_backend(n), spec)]
        name = serving[0] if serving else names[-1]  # (none: the last one says why)
    else:
        name = cache.attention_backend
    backend = get_backend(name)
    reason = backend.why_not(spec.kind, spec.dtype, spec.head_dim, spec.softcap is not None)
    if reason is not None:
        raise PlanError(f"attention backend {name!r} cannot serve {spec.kind} layers: it {reason}")
    if backend.needs is not None and backend.needs not in capabilities:
        others = [n for n, b in BACKENDS.items() if b.impl and b.needs in (None, *capabilities)]
        raise PlanError(
            f"attention backend {name!r} needs {backend.needs}, which this machine does not "
            f"have; it can run: {', '.join(others)}"
        )
    return [backend]


def _serves(backend: AttentionBackendInfo, spec: AttentionSpec | MLASpec) -> bool:
    return backend.why_not(spec.kind, spec.dtype, spec.head_dim, spec.softcap is not None) is None


def _check_state_fits(spec: StateSpec, page_bytes: int, page_tokens: int, a: int) -> None:
    if spec.state_bytes > page_bytes:
        need = math.ceil(spec.state_bytes / a)
        raise PlanError(
            f"page_tokens={page_tokens} is too small for the {spec.kind} state: a page "
            f"holds {page_bytes} bytes but the state needs {spec.state_bytes}; use "
            f"page_tokens >= {need} (or leave it unset)"
        )
    for t in spec.tensors:
        if page_bytes % dtype_bytes(t.dtype):
            raise PlanError(
                f"page_bytes={page_bytes} is not a multiple of {t.dtype} for state "
                f"tensor {t.name!r}; choose a page_tokens that is a multiple of 16"
            )


def select_state_ops(
    spec: StateSpec,
    platform: str,
    compute_dtype: str,
    capabilities: frozenset[str] = DEFAULT_CAPABILITIES,
    requested: str | None = None,
) -> str | None:
    """The ops a state group runs on: `requested` if given (validated), else the first entry
    of the spec's declaration that runs on `platform` with the state dtypes and
    `compute_dtype` and whose needs the machine has. None for plan-only kinds (no declaration).
    """
    if not spec.ops:
        return None
    dtypes = (*spec.dtypes, compute_dtype)
    declared = ", ".join(o.name for o in spec.ops)
    if requested is not None:
        chosen = [o for o in spec.ops if o.name == requested]
        if not chosen:
            raise PlanError(
                f"state_backend={requested!r} is not declared for {spec.kind} layers; "
                f"declared: {declared}"
            )
        reason = chosen[0].why_not(platform, dtypes, capabilities, compute_dtype)
        if reason is not None:
            raise PlanError(
                f"state_backend={requested!r} cannot run the {spec.kind} layers here: it {reason}"
            )
        return requested
    reasons = []
    for ops in spec.ops:
        reason = ops.why_not(platform, dtypes, capabilities, compute_dtype)
        if reason is None:
            return ops.name
        reasons.append(f"{ops.name} {reason}")
    raise PlanError(f"no declared ops can run the {spec.kind} layers here: {'; '.join(reasons)}")


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def _page_size(
    attn: Sequence[AttentionSpec | MLASpec],
    states: Sequence[StateSpec],
    align: int,
    cache: CacheConfig,
) -> tuple[int, int, int, int]:
    """(page_tokens, page_bytes, A, M) for the reference attention spec (largest bytes/token)."""
    if not attn:
        return _pure_state_page_size(states, align)
    a = max(s.bytes_per_token for s in attn)
    m = max((s.state_bytes for s in states), default=0)
    if states and cache.page_tokens is None:
        page_tokens = hybrid_page_tokens(m, a, align)
    else:
        page_tokens = cache.page_tokens or align
    page_bytes = page_tokens * a
    for spec in states:
        _check_state_fits(spec, page_bytes, page_tokens, a)
    return page_tokens, page_bytes, a, m


def _pure_state_page_size(states: Sequence[StateSpec], align: int) -> tuple[int, int, int, int]:
    """A model without attention layers (Mamba, Mamba2, FalconMamba): a page holds one state,
    the largest, rounded up to PAGE_BYTES_ALIGN; page_tokens (`align`: CacheConfig.page_tokens
    or DEFAULT_PAGE_TOKENS) is then only the prefix-hash block, so states are snapshotted (and
    prefix hits land) at multiples of it. A = 0: no token takes page bytes."""
    if not states:
        raise PlanError("the model declares no cache layers: nothing to plan")
    m = max(s.state_bytes for s in states)
    page_bytes = -(-m // PAGE_BYTES_ALIGN) * PAGE_BYTES_ALIGN
    return align, page_bytes, 0, m


def _attention_group(
    gid: int,
    spec: AttentionSpec | MLASpec,
    members: Sequence[CacheLayer],
    page_bytes: int,
    cache: CacheConfig,
    ctx: PlanContext,
    capabilities: frozenset[str],
) -> GroupPlan:
    if page_bytes % spec.bytes_per_token:
        raise PlanError(
            f"page_bytes={page_bytes} is not a whole number of tokens for the "
            f"{spec.kind} layers ({spec.bytes_per_token} bytes per token)"
        )
    tokens = page_bytes // spec.bytes_per_token
    backends = _group_backends(spec, cache, capabilities)
    size = select_kernel_block_size(tokens, backends, spec.head_dim, ctx, cache.kernel_block_size)
    return GroupPlan(
        gid,
        spec,
        tuple(m.name for m in members),
        tokens,
        size,
        backends[0].name,
        0,
        tuple(m.layer_index for m in members),
        cache.allocation,
    )


def _state_group(
    gid: int,
    spec: StateSpec,
    members: Sequence[CacheLayer],
    page_bytes: int,
    cache: CacheConfig,
    target: PlanTarget,
) -> GroupPlan:
    ops = select_state_ops(
        spec, cache.platform, target.compute_dtype, target.capabilities, cache.state_backend
    )
    return GroupPlan(
        gid,
        spec,
        tuple(m.name for m in members),
        None,
        None,
        ops,
        page_bytes - spec.state_bytes,
        tuple(m.layer_index for m in members),
        cache.allocation,
    )


def _auto_num_pages(
    groups: Sequence[GroupPlan],
    per_page: int,
    max_model_len: int,
    max_num_seqs: int,
    reserved_bytes: int = 0,
) -> int:
    """Pages for `max_num_seqs` requests of `max_model_len` tokens (a running and a snapshot
    page per state group, whole pages per attention group), capped at AUTO_BUDGET_BYTES less
    `reserved_bytes`."""
    per_request = sum(
        2 if g.page_tokens is None else math.ceil(max_model_len / g.page_tokens) for g in groups
    )
    cap = max(0, AUTO_BUDGET_BYTES - reserved_bytes) // per_page
    if cap < per_request + NULL_PAGES:
        scratch = (
            f" after {reserved_bytes:,} bytes of speculative-decoding state scratch"
            if reserved_bytes else ""
        )  # fmt: skip
        raise PlanError(
            f"max_model_len={max_model_len} needs {per_request + NULL_PAGES} pages but "
            f"{AUTO_BUDGET_BYTES // 2**30} GiB hold {cap}{scratch}; lower max_model_len or give "
            "memory_bytes" + (_SCRATCH_HINT if reserved_bytes else "")
        )
    return min(per_request * max_num_seqs + NULL_PAGES, cap)


def _num_pages(
    cache: CacheConfig, groups: Sequence[GroupPlan], per_page: int, target: PlanTarget
) -> int:
    needed = len(groups) + NULL_PAGES
    if cache.num_pages is not None:
        if cache.num_pages < needed:
            raise PlanError(
                f"num_pages={cache.num_pages} is too small: this model needs at least "
                f"{needed} (one page per group plus the null page)"
            )
        return cache.num_pages
    reserved = target.reserved_bytes
    if cache.memory_bytes is None and target.max_num_seqs is not None:
        return _auto_num_pages(
            groups, per_page, target.max_model_len, target.max_num_seqs, reserved
        )
    num_pages = (cache.budget_bytes - reserved) // per_page
    if num_pages < needed:
        scratch = f" after {reserved:,} bytes of speculative-decoding state scratch"
        raise PlanError(
            f"memory budget {cache.budget_bytes} bytes is too small{scratch if reserved else ''}: "
            f"one page per group plus the null page needs {needed * per_page} bytes"
            + (_SCRATCH_HINT if reserved else "")
        )
    return num_pages


_SCRATCH_HINT = (
    "; lower num_speculative_tokens, max_num_seqs, or the batch sizes that draft "
    "(disable_by_batch_size, num_speculative_tokens_per_batch_size)"
)


@dataclass(frozen=True)
class PlanTarget:
    """What the plan needs to know besides the specs and the cache config.

    - `max_model_len`: sizes the block tables (and the automatic budget);
    - `max_num_seqs`: with no `memory_bytes` / `num_pages`, size the pool for this many requests
      of max_model_len tokens (at most AUTO_BUDGET_BYTES); None: `CacheConfig.budget_bytes`;
    - `compute_dtype`, `capabilities`: choose each state group's ops from its declaration;
    - `reserved_bytes`: budget taken outside the pages (speculative decoding's state scratch:
      `speculation_scratch`), before the pages are counted.
    """

    max_model_len: int = 4096
    max_num_seqs: int | None = None
    compute_dtype: str = "float32"
    capabilities: frozenset[str] = DEFAULT_CAPABILITIES
    reserved_bytes: int = 0


def make_plan(
    layers: Sequence[CacheLayer],
    cache: CacheConfig,
    architecture: str = "",
    target: PlanTarget | None = None,
) -> MemoryPlan:
    """The memory plan of a model's cache layers under a cache config (design.md section 3)."""
    target = target or PlanTarget()
    buckets = _bucket(layers)
    attn = [s for s in buckets if not isinstance(s, StateSpec)]
    states = [s for s in buckets if isinstance(s, StateSpec)]
    ctx = PlanContext(
        is_hybrid=bool(states) and bool(attn),
        fp32_state=any(t.dtype == "float32" for s in states for t in s.tensors),
    )
    caps = target.capabilities
    smallest = max(
        (
            b.smallest_accepted(s.head_dim, ctx)
            for s in attn
            for b in _group_backends(s, cache, caps)
        ),
        default=1,
    )
    align = max(smallest, cache.page_tokens or DEFAULT_PAGE_TOKENS)
    page_tokens, page_bytes, a, m = _page_size(attn, states, align, cache)

    lpg = layers_per_group_for([len(v) for v in buckets.values()])
    groups: list[GroupPlan] = []
    for spec, members in buckets.items():
        for chunk in split_bucket(members, lpg):
            gid = len(groups)
            if isinstance(spec, StateSpec):
                groups.append(_state_group(gid, spec, chunk, page_bytes, cache, target))
            else:
                groups.append(_attention_group(gid, spec, chunk, page_bytes, cache, ctx, caps))
    return MemoryPlan(
        architecture=architecture,
        platform=cache.platform,
        page_tokens=page_tokens,
        page_bytes=page_bytes,
        num_pages=_num_pages(cache, groups, page_bytes * lpg, target),
        layers_per_group=lpg,
        groups=tuple(groups),
        attention_bytes_per_token=a,
        state_bytes=m,
        align=align,
        max_model_len=target.max_model_len,
        context=ctx,
        allocation=cache.allocation,
        reserved_bytes=target.reserved_bytes,
    )


def state_ops_class(group: GroupPlan) -> Any:
    """The ops class the plan chose for a state group (declared by its layer kind as a
    "module:Class" string, imported here)."""
    assert isinstance(group.spec, StateSpec)
    for ops in group.spec.ops:
        if ops.name == group.backend:
            module, _, name = ops.impl.partition(":")
            return getattr(importlib.import_module(module), name)
    declared = ", ".join(o.name for o in group.spec.ops) or "none"
    raise ValueError(
        f"group {group.group_id} ({group.kind}) has no runnable ops {group.backend!r}; "
        f"declared: {declared}"
    )


def keeps_positions(plan: MemoryPlan) -> bool:
    """Whether the ops of every state group keep the state after every position of a chunk
    (`keeps_positions`): speculative decoding then commits each request's accepted position
    instead of rewinding it (docs/speculative-decoding.md, "State layers")."""
    groups = plan.state_groups
    return bool(groups) and all(
        getattr(state_ops_class(g), "keeps_positions", False) for g in groups
    )


def speculation_scratch(plan: MemoryPlan, rows: int, k: int) -> tuple[int, int]:
    """(states kept per scratch row, scratch bytes) of speculative decoding on this plan:
    `rows` requests drafting at once, k drafts at most. A row holds every state layer's state
    once (saved before a verify step, rejections rewind) or k times (the state ops keep the
    state after each position). No state groups: no scratch."""
    if not rows or not plan.state_groups:
        return 0, 0
    depth = k if keeps_positions(plan) else 1
    per_request = sum(len(g.layer_names) * g.spec.state_bytes for g in plan.state_groups)
    return depth, rows * depth * per_request


def make_speculative_plan(
    layers: Sequence[CacheLayer],
    cache: CacheConfig,
    architecture: str,
    target: PlanTarget,
    rows: int,
    k: int,
) -> MemoryPlan:
    """make_plan with speculative decoding's state scratch (`speculation_scratch`) for `rows`
    drafting requests taken out of the budget before the pages are counted, at most
    SCRATCH_SHARE of it: fewer rows when it would take more (`MemoryPlan.scratch_rows`; requests
    beyond them decode without drafts in that step). An explicit num_pages keeps its pages and
    all the rows; the scratch comes on top (reported as reserved_bytes)."""
    plan = make_plan(layers, cache, architecture, target)
    _, scratch = speculation_scratch(plan, rows, k)
    if not scratch:
        return plan
    per_row = scratch // rows
    if cache.num_pages is None:
        auto = cache.memory_bytes is None and target.max_num_seqs is not None
        budget = AUTO_BUDGET_BYTES if auto else cache.budget_bytes
        rows = min(rows, max(1, int(budget * SCRATCH_SHARE) // per_row))
    target = dataclasses.replace(target, reserved_bytes=rows * per_row)
    plan = make_plan(layers, cache, architecture, target)
    return dataclasses.replace(plan, scratch_rows=rows)

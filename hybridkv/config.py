"""Frozen configuration dataclasses. Their fields are the keyword arguments of `LLM(...)`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hybridkv.dtypes import STATE_DTYPES, canonical_dtype

DEFAULT_MEMORY_BYTES = 4 * 2**30
ALLOCATION_MODES = ("page", "block")
# hybridkv.layers.quantization: int8 weight-only; w8a8 int8 weights and per-token int8 activations
QUANTIZATIONS = ("int8", "w8a8")


def _positive_or_none(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def check_bools(config: object, *names: str) -> None:
    """Flags must be True or False: "no" or 0 would read as something else."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def check_quantization(value: object) -> None:
    """None or a supported method; anything else a one-line error naming what is allowed."""
    if value is not None and value not in QUANTIZATIONS:
        allowed = ", ".join(repr(q) for q in QUANTIZATIONS)
        raise ValueError(f"quantization must be None or one of {allowed}, got {value!r}")


def check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a name (a string), got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged cache is sized and used.

    - `page_tokens`: tokens per attention page (None: derived from the model, design.md 3.3).
    - `kernel_block_size`: tokens per kernel block (None: chosen from the backends' declarations).
    - `memory_bytes` or `num_pages`: the budget (at most one; default 4 GiB).
    - `allocation`: "page" (reference behaviour, whole pages) or "block" (kernel-block
      sub-allocation, the default).
    - `attention_backend`: the attention backend of every attention group (None: the platform's
      default); `state_backend`: the ops of every state group, by the name its layer kind
      declares ("native", "triton", "compiled", "torch"; None: the first that runs here).
    """

    page_tokens: int | None = None
    kernel_block_size: int | None = None
    kv_cache_dtype: str = "auto"
    state_dtype: str = "auto"
    ssm_state_dtype: str = "auto"
    memory_bytes: int | None = None
    num_pages: int | None = None
    allocation: str = "block"
    enable_prefix_caching: bool = True
    platform: str = "cpu"
    attention_backend: str | None = None
    state_backend: str | None = None
    # State snapshot policy (which token counts get a state snapshot for prefix caching):
    snapshot_prompt_end: bool = True  # the last hit boundary inside the prompt
    snapshot_request_end: bool = True  # the last boundary a request reached (rolling tail)
    snapshot_tail_interval_tokens: int = 64  # rolling tail granularity (rounded to hit blocks)
    snapshot_branch_point: bool = True  # where a new prompt's attention hit outruns its state hit
    snapshot_interval_blocks: int | None = None  # also every N hit blocks inside the prompt
    max_snapshots_per_request: int = 4  # cap on prompt snapshots (the rolling tail is one more)
    debug_checks: bool = False  # run the allocator integrity check after every step

    def __post_init__(self) -> None:
        check_bools(
            self, "enable_prefix_caching", "snapshot_prompt_end", "snapshot_request_end",
            "snapshot_branch_point", "debug_checks",
        )  # fmt: skip
        for name in ("kv_cache_dtype", "state_dtype", "ssm_state_dtype", "platform", "allocation"):
            check_name(name, getattr(self, name))
        _positive_or_none("page_tokens", self.page_tokens)
        _positive_or_none("kernel_block_size", self.kernel_block_size)
        _positive_or_none("memory_bytes", self.memory_bytes)
        _positive_or_none("num_pages", self.num_pages)
        _positive_or_none("snapshot_interval_blocks", self.snapshot_interval_blocks)
        _positive_or_none("snapshot_tail_interval_tokens", self.snapshot_tail_interval_tokens)
        if (
            isinstance(self.max_snapshots_per_request, bool)
            or not isinstance(self.max_snapshots_per_request, int)
            or self.max_snapshots_per_request < 0
        ):
            raise ValueError(
                f"max_snapshots_per_request must be an integer >= 0, got "
                f"{self.max_snapshots_per_request!r}"
            )
        if self.memory_bytes is not None and self.num_pages is not None:
            raise ValueError("give memory_bytes or num_pages, not both")
        if self.allocation not in ALLOCATION_MODES:
            raise ValueError(
                f"allocation must be one of {', '.join(ALLOCATION_MODES)}, got {self.allocation!r}"
            )
        if self.kv_cache_dtype != "auto":
            object.__setattr__(self, "kv_cache_dtype", canonical_dtype(self.kv_cache_dtype))
        for name in ("state_dtype", "ssm_state_dtype"):
            value = getattr(self, name)
            if value != "auto" and canonical_dtype(value) not in STATE_DTYPES:
                raise ValueError(
                    f"{name} must be auto or one of {', '.join(STATE_DTYPES)}, got {value!r}"
                )
            if value != "auto":
                object.__setattr__(self, name, canonical_dtype(value))
        # Imported here so that the registry stays importable on its own.
        from hybridkv.layers.attention.registry import get_backend, get_platform

        get_platform(self.platform)
        if self.attention_backend is not None:
            check_name("attention_backend", self.attention_backend)
            get_backend(self.attention_backend)
        if self.state_backend is not None and (
            not isinstance(self.state_backend, str) or not self.state_backend.isidentifier()
        ):
            raise ValueError(
                f"state_backend must be a name such as 'torch' or 'native', got "
                f"{self.state_backend!r}"
            )

    @property
    def budget_bytes(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else DEFAULT_MEMORY_BYTES


def split_kwargs(kwargs: dict[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Split flat `LLM(**kwargs)` into one dict per config class; unknown keys are an error."""
    out: list[dict[str, Any]] = []
    left = dict(kwargs)
    for cls in classes:
        names = {f.name for f in fields(cls)}
        out.append({k: left.pop(k) for k in list(left) if k in names})
    if left:
        valid = sorted({f.name for cls in classes for f in fields(cls)})
        raise ValueError(f"unknown option(s) {', '.join(sorted(left))}; valid: {', '.join(valid)}")
    return out


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    - `max_num_seqs`: requests running at once (rows of the block tables).
    - `max_num_batched_tokens`: tokens per step (decodes plus prefill chunks).
    - `max_model_len`: the longest request (prompt + output); None: the model's own limit.
    - `speculative_config`: vLLM's `speculative_config` (a dict, JSON text or a
      `hybridkv.spec_decode.SpeculativeConfig`; docs/speculative-decoding.md): decode steps
      verify drafts (method "ngram": prompt lookup) and keep the accepted ones. None: off.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    speculative_config: Any = None

    def __post_init__(self) -> None:
        _positive_or_none("max_num_seqs", self.max_num_seqs)
        _positive_or_none("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_or_none("max_model_len", self.max_model_len)
        from hybridkv.spec_decode.config import SpeculativeConfig

        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes share the model (`hybridkv.distributed`).

    - `tensor_parallel_size`: ranks the model is sharded over (attention and state heads,
      MLP/expert intermediate sizes, vocabulary); `LLM(...)` and `serve` start the other ranks'
      processes themselves, or join a `torchrun` launch (env:// rendezvous).
    - `distributed_timeout_s`: how long a collective waits for a rank before the engine gives
      up with an error (a dead or hung rank never hangs the run).
    """

    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"distributed_timeout_s must be a number > 0, got {timeout!r}")

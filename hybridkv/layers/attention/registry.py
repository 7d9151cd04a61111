"""Attention backend declarations and platforms (pure data; implementations import lazily).

Every backend declares what it supports: the kernel block sizes it accepts (exact ints and/or
"any multiple of n"), the dtypes and head dims it runs, the layer kinds it serves, whether it
soft-caps attention logits (`softcap`) and the (kernel_block_size, head_dim) combinations it
refuses. The memory plan chooses kernel block
sizes from these declarations only; nothing in the engine special-cases a backend.

Sizes follow what vLLM's backends declare; `torch` is hybridkv's reference backend and `triton`
its GPU backend. The others are declared so that plans for them can be computed and compared;
they have no implementation here (`impl is None`). The MLA ones name the backend that runs their
groups instead (`runs_on`: hybridkv's Triton MLA decode over the same kernel blocks), so a cuda
plan may keep FlashMLA's block sizes and still run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from hybridkv.dtypes import canonical_dtype


@dataclass(frozen=True)
class KernelBlockSizes:
    """Accepted kernel block sizes: exact ints and/or any multiple of `multiple_of`."""

    ints: tuple[int, ...] = ()
    multiple_of: int | None = None

    def __post_init__(self) -> None:
        if not self.ints and self.multiple_of is None:
            raise ValueError("a backend must accept at least one kernel block size")
        if any(i <= 0 for i in self.ints) or (
            self.multiple_of is not None and self.multiple_of <= 0
        ):
            raise ValueError(f"kernel block sizes must be positive, got {self}")
        object.__setattr__(self, "ints", tuple(sorted(set(self.ints))))

    def accepts(self, size: int) -> bool:
        if size in self.ints:
            return True
        return self.multiple_of is not None and size > 0 and size % self.multiple_of == 0

    def describe(self) -> str:
        parts = [str(i) for i in self.ints]
        if self.multiple_of is not None:
            parts.append(
                "any size" if self.multiple_of == 1 else f"any multiple of {self.multiple_of}"
            )
        return "/".join(parts)


ANY_SIZE = KernelBlockSizes(multiple_of=1)
MULTIPLE_OF_16 = KernelBlockSizes(multiple_of=16)
ALL_FLOAT = frozenset({"float32", "bfloat16", "float16"})
HALF = frozenset({"bfloat16", "float16"})
HALF_AND_FP8 = frozenset({"bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"})


@dataclass(frozen=True)
class PlanContext:
    """What a backend's declaration may depend on besides the layer spec."""

    is_hybrid: bool = False
    fp32_state: bool = False


@dataclass(frozen=True)
class AttentionBackendInfo:
    name: str
    block_sizes: KernelBlockSizes
    kinds: frozenset[str] = frozenset({"attention", "sliding_window"})
    dtypes: frozenset[str] = HALF
    head_dims: tuple[int, ...] | None = None  # None: any head dim
    # (kernel_block_size, head_dim) pairs the backend refuses.
    excluded: tuple[tuple[int, int], ...] = ()
    # Sizes that replace `block_sizes` for hybrid models whose state is float32.
    hybrid_fp32_state_block_sizes: KernelBlockSizes | None = None
    impl: str | None = None  # "module:Class", imported on first use
    needs: str | None = None  # a capability the machine must have to run it ("triton")
    description: str = ""
    runs_on: str | None = None  # without an impl: the implemented backend that runs its groups
    softcap: bool = False  # attention logit soft-capping (c * tanh(s / c)) of the scores

    @property
    def runner(self) -> str | None:
        """The name of the backend that runs this one's groups (None: plan only)."""
        return self.name if self.impl is not None else self.runs_on

    def sizes_for(self, ctx: PlanContext) -> KernelBlockSizes:
        if ctx.is_hybrid and ctx.fp32_state and self.hybrid_fp32_state_block_sizes is not None:
            return self.hybrid_fp32_state_block_sizes
        return self.block_sizes

    def accepts(self, size: int, head_dim: int, ctx: PlanContext) -> bool:
        return self.sizes_for(ctx).accepts(size) and (size, head_dim) not in self.excluded

    def smallest_accepted(self, head_dim: int, ctx: PlanContext) -> int:
        """The smallest kernel block size accepted for this head dim (exclusions honoured)."""
        sizes = self.sizes_for(ctx)
        candidates = [i for i in sizes.ints if (i, head_dim) not in self.excluded]
        if sizes.multiple_of is not None:
            size = sizes.multiple_of
            while (size, head_dim) in self.excluded:
                size += sizes.multiple_of
            candidates.append(size)
        if not candidates:
            raise ValueError(
                f"attention backend {self.name!r} accepts no kernel block size for "
                f"head dim {head_dim}"
            )
        return min(candidates)

    def why_not(self, kind: str, dtype: str, head_dim: int, softcap: bool = False) -> str | None:
        """Why this backend cannot serve a layer of this kind, dtype and head dim, with logit
        soft-capping if `softcap` (None: it can)."""
        if kind not in self.kinds:
            return f"serves {', '.join(sorted(self.kinds))}, not {kind}"
        if canonical_dtype(dtype) not in self.dtypes:
            return f"runs dtypes {', '.join(sorted(self.dtypes))}, not {dtype}"
        if self.head_dims is not None and head_dim not in self.head_dims:
            dims = ", ".join(map(str, self.head_dims))
            return f"runs head dims {dims}, not {head_dim}"
        if softcap and not self.softcap:
            return "has no attention logit soft-capping"
        return None

    def load(self) -> type:
        if self.impl is None and self.runs_on is not None:
            return get_backend(self.runs_on).load()
        if self.impl is None:
            implemented = ", ".join(n for n, b in BACKENDS.items() if b.impl is not None)
            raise ValueError(
                f"attention backend {self.name!r} is declared for planning only and "
                f"has no implementation in hybridkv; implemented: {implemented}"
            )
        module, _, attr = self.impl.partition(":")
        return getattr(importlib.import_module(module), attr)


_ATTN = frozenset({"attention", "sliding_window"})
_MLA = frozenset({"mla"})

BACKENDS: dict[str, AttentionBackendInfo] = {
    b.name: b
    for b in (
        AttentionBackendInfo(
            "torch",
            ANY_SIZE,
            _ATTN | _MLA,
            ALL_FLOAT | {"fp8_e4m3", "fp8_e5m2"},
            impl="hybridkv.layers.attention.torch_backend:TorchAttentionBackend",
            description="hybridkv's PyTorch reference (CPU default)",
            softcap=True,
        ),
        AttentionBackendInfo(
            "triton",
            MULTIPLE_OF_16,
            _ATTN | _MLA,
            ALL_FLOAT,
            impl="hybridkv.layers.attention.triton_backend:TritonAttentionBackend",
            needs="triton",
            description="hybridkv's Triton kernels (CUDA / ROCm default)",
            softcap=True,
        ),
        AttentionBackendInfo(
            "flash_attn",
            MULTIPLE_OF_16,
            _ATTN,
            HALF_AND_FP8,
            hybrid_fp32_state_block_sizes=KernelBlockSizes((16, 32, 64)),
            softcap=True,  # (vLLM passes logits_soft_cap to FlashAttention's softcap)
        ),
        AttentionBackendInfo(
            "flashinfer",
            KernelBlockSizes((16, 32, 64)),
            _ATTN,
            HALF_AND_FP8,
            excluded=((16, 256),),
            softcap=True,  # (FlashInfer's logits_soft_cap)
        ),
        AttentionBackendInfo(
            "flashmla",
            KernelBlockSizes((64,)),
            _MLA,
            HALF_AND_FP8,
            runs_on="triton",
            needs="triton",
        ),
        AttentionBackendInfo(
            "cutlass_mla",
            KernelBlockSizes((128,)),
            _MLA,
            HALF_AND_FP8,
            runs_on="triton",
            needs="triton",
        ),
        AttentionBackendInfo(
            "flashinfer_mla",
            KernelBlockSizes((32, 64)),
            _MLA,
            HALF_AND_FP8,
            runs_on="triton",
            needs="triton",
        ),
        AttentionBackendInfo("rocm_attn", KernelBlockSizes((16, 32)), _ATTN, HALF_AND_FP8),
        AttentionBackendInfo("rocm_aiter_fa", KernelBlockSizes((16, 32)), _ATTN, HALF_AND_FP8),
        AttentionBackendInfo("cpu_attn", MULTIPLE_OF_16, _ATTN, ALL_FLOAT),
    )
}


def get_backend(name: str) -> AttentionBackendInfo:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(BACKENDS)}")
    return BACKENDS[name]


@dataclass(frozen=True)
class Platform:
    """A platform names its default backends per attention-like layer kind, in order of
    preference: a group takes the first whose declaration serves its layers (kind, dtype, head
    dim, softcap) and whose needs the machine has."""

    name: str
    defaults: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def default_backends(self, kind: str) -> tuple[str, ...]:
        return self.defaults["mla" if kind == "mla" else "attention"]


PLATFORMS: dict[str, Platform] = {
    "cpu": Platform("cpu", {"attention": ("torch",), "mla": ("torch",)}),
    # FlashMLA's layout (kernel blocks of 64) for half precision; float32 MLA on Triton's
    "cuda": Platform("cuda", {"attention": ("triton",), "mla": ("flashmla", "triton")}),
    "rocm": Platform("rocm", {"attention": ("triton",), "mla": ("triton",)}),
}


def get_platform(name: str) -> Platform:
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; valid: {', '.join(PLATFORMS)}")
    return PLATFORMS[name]

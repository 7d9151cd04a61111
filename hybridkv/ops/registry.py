"""Stateless op families and their declared implementations, chosen once.

Every op family that is not a cache owner (linears, norms, activations, RoPE, KV writes, decode
attention, MoE experts, ...) declares an ordered list of implementations, each with what it
needs: devices, dtypes, instruction sets or libraries (the names of `CpuRecord.usable`, plus
"native", "onednn", "onednn_bf16"), and the rows of input up to which it applies. For a device
and a dtype the family takes, in order, every implementation that can run here until one that
applies at any size: that chain is the choice, made once per process and (device, dtype), and
printed by `hybridkv plan`, `hybridkv bench` and the engine's start-up log:

    op              dtype     implementation
    linear          bfloat16  native-avx512-bf16 (rows <= 16), onednn-packed
    rms_norm        bfloat16  native

A call looks the chain up by its input's (device, dtype) and runs the link for its rows; no
implementation is tried and abandoned at call time (an implementation declared for a dtype takes
every input of it, or raises). A call whose inputs mix dtypes (a float32 residual into a float16
norm, a float16 query over a bfloat16 cache) names them all (`OpFamily.of(x, *others)`): its
chain, keyed e.g. "float16+float32", holds only implementations declared for every one. The
state kinds (Mamba, GDN, KDA, short conv) declare their ops the same way with
`hybridkv.kv.specs.StateOps`, chosen per cache group by the plan.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CPU_FLOATS = frozenset({"float32", "bfloat16"})
ANY_DEVICE = frozenset({"cpu", "cuda"})


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op family: `fn` ("module:function") takes the family's
    arguments. It runs on `devices` for inputs of `dtypes` when the machine has every one of
    `needs`, for inputs of up to `max_rows` rows (None: any)."""

    name: str
    fn: str
    devices: frozenset[str] = ANY_DEVICE
    dtypes: frozenset[str] | None = None  # None: any dtype
    needs: tuple[str, ...] = ()
    # rows of input up to which it applies (None: any); a function is read at each call (a
    # limit that depends on the build, or that a test changes)
    max_rows: int | Callable[[], int] | None = None
    description: str = ""
    # runs only where the machine lacks these (an AVX2 path where the AVX-512 one runs instead)
    unless: tuple[str, ...] = ()
    # `fn` answers None for tensors it does not take (the native wrappers do): bound strictly,
    # such an answer raises (an implementation declared for a dtype takes all of its inputs)
    strict: bool = False

    def why_not(self, device: str, dtype: str, have: frozenset[str]) -> str | None:
        """Why this implementation cannot run here (None: it can)."""
        if device not in self.devices:
            return f"runs on {', '.join(sorted(self.devices))}, not {device}"
        # a mixed call's key names every input dtype ("bfloat16+float32"): all must be taken
        if self.dtypes is not None and not set(dtype.split("+")) <= self.dtypes:
            return f"takes {', '.join(sorted(self.dtypes))}, not {dtype}"
        missing = [n for n in self.needs if n not in have]
        if missing:
            return f"needs {', '.join(missing)}"
        better = [n for n in self.unless if n in have]
        if better:
            return f"gives way where the machine has {', '.join(better)}"
        return None

    def load(self) -> Callable[..., Any]:
        module, _, name = self.fn.partition(":")
        fn = getattr(importlib.import_module(module), name)
        return _strict(fn, self) if self.strict else fn


def _limit(impl: OpImpl) -> float:
    rows = impl.max_rows() if callable(impl.max_rows) else impl.max_rows
    return float("inf") if rows is None else rows


def _strict(fn: Callable[..., Any], impl: OpImpl) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if out is None:
            shapes = [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            raise OpError(f"{impl.fn} declined tensors {shapes} it is declared for")
        return out

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


@dataclass(frozen=True)
class Link:
    """One link of a chosen chain: `run` for inputs of up to `max_rows` rows (None: any)."""

    impl: OpImpl
    run: Callable[..., Any]

    @property
    def max_rows(self) -> int | None:
        limit = self.impl.max_rows
        return limit() if callable(limit) else limit


@dataclass(frozen=True)
class Chain:
    """What a family runs for one (device, dtype): links in order, the last for any rows."""

    family: str
    device: str
    dtype: str
    links: tuple[Link, ...]

    def for_rows(self, num_rows: int) -> Callable[..., Any]:
        for link in self.links:
            if link.max_rows is None or num_rows <= link.max_rows:
                return link.run
        raise AssertionError("a chain ends with a link for any rows")  # (choose ensures it)

    @property
    def first(self) -> Callable[..., Any]:
        return self.links[0].run

    def describe(self) -> str:
        parts = []
        for link in self.links:
            rows = "" if link.max_rows is None else f" (rows <= {link.max_rows})"
            parts.append(f"{link.impl.name}{rows}")
        return ", ".join(parts)


class OpError(RuntimeError):
    """No declared implementation of a family runs here."""


@dataclass
class OpFamily:
    """An op family: its declared implementations in order of preference."""

    name: str
    impls: tuple[OpImpl, ...]
    description: str = ""
    _chains: dict[tuple[str, str], Chain] = field(default_factory=dict, repr=False)
    # `of` with several inputs: (device, their torch dtypes) -> the chain of their names
    _by_dtypes: dict[tuple[str, tuple], Chain] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        names = [i.name for i in self.impls]
        if len(set(names)) != len(names):
            raise ValueError(f"op family {self.name!r} declares {names}: names must be unique")
        if not self.impls or self.impls[-1].max_rows is not None:
            raise ValueError(
                f"op family {self.name!r} must end with an implementation for any rows"
            )

    def choose(self, device: str, dtype: str, have: frozenset[str]) -> tuple[OpImpl, ...]:
        """The chain for (device, dtype) on a machine with `have` (OpError naming every
        implementation's reason when none runs)."""
        chain, reasons = [], []
        for impl in self.impls:
            reason = impl.why_not(device, dtype, have)
            if reason is not None:
                reasons.append(f"{impl.name} {reason}")
                continue
            if chain and _limit(impl) <= _limit(chain[-1]):
                continue  # every input it would take goes to the link before it
            chain.append(impl)
            if impl.max_rows is None:
                return tuple(chain)
        raise OpError(
            f"no implementation of {self.name} runs {dtype} on {device} here: {'; '.join(reasons)}"
        )

    def chain(
        self, device: str | torch.device, dtype: str | torch.dtype, without: tuple[str, ...] = ()
    ) -> Chain:
        """The chain for (device, dtype), chosen on first use and kept for the process;
        `without`: as if the machine lacked these (a layer whose weight a kernel cannot take)."""
        key = (_device_type(device), _dtype_name(dtype))
        found = self._chains.get(key if not without else (*key, *without))
        if found is None:
            with _LOCK:
                have = capabilities(key[0]) - frozenset(without)
                impls = self.choose(*key, have)
                links = tuple(Link(i, i.load()) for i in impls)
                found = Chain(self.name, *key, links)
                self._chains[key if not without else (*key, *without)] = found
        return found

    def of(self, x: torch.Tensor, *others: torch.Tensor | None) -> Chain:
        """The chain for x's device and dtype (a dict lookup after the first call). `others`:
        more inputs of the call (None skipped); where their dtypes differ from x's (a float32
        residual into a float16 norm, a float16 query over a bfloat16 cache) the chain is the
        mixed key's, e.g. "float16+float32", whose implementations are declared for every one
        of the dtypes (every call of a bfloat16 Mamba2 layer's gated norm is such a call: the
        dtypes' tuple is looked up, the key named once)."""
        for t in others:
            if t is not None and t.dtype != x.dtype:
                return self._mixed(x, others)
        found = self._chains.get((x.device.type, _DTYPE_NAMES.get(x.dtype, "-")))
        return found if found is not None else self.chain(x.device, x.dtype)

    def _mixed(self, x: torch.Tensor, others: tuple[torch.Tensor | None, ...]) -> Chain:
        dtypes = (x.dtype, *(None if t is None else t.dtype for t in others))
        found = self._by_dtypes.get((x.device.type, dtypes))
        if found is None:
            names = sorted({_DTYPE_NAMES.get(d, "-") for d in dtypes if d is not None})
            found = self._by_dtypes[(x.device.type, dtypes)] = self.chain(x.device, "+".join(names))
        return found

    def reset(self) -> None:
        """Forget the chosen chains (tests that change what the machine has)."""
        self._chains.clear()
        self._by_dtypes.clear()


_LOCK = threading.Lock()
FAMILIES: dict[str, OpFamily] = {}
# modules that declare families, imported by `table` so that every family is listed
DECLARING_MODULES: tuple[str, ...] = (
    "hybridkv.ops.norm",
    "hybridkv.layers.activation",
    "hybridkv.ops.elementwise",
    "hybridkv.ops.attention",
    "hybridkv.ops.mla",
    "hybridkv.layers.rotary",
    "hybridkv.layers.linear",
    "hybridkv.layers.quantization",
    "hybridkv.worker.sampler",
    "hybridkv.layers.mlp",
    "hybridkv.layers.moe",
    "hybridkv.layers.gated_delta_net",
    "hybridkv.layers.kda",
    "hybridkv.distributed.layers",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def declare(name: str, impls: Sequence[OpImpl], description: str = "") -> OpFamily:
    """Register an op family (once per name)."""
    if name in FAMILIES:
        raise ValueError(f"op family {name!r} is declared twice")
    family = FAMILIES[name] = OpFamily(name, tuple(impls), description)
    return family


def lookup(name: str) -> OpFamily:
    _import_declaring()
    if name not in FAMILIES:
        raise KeyError(f"unknown op family {name!r}; declared: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def _device_type(device: str | torch.device) -> str:
    return device if isinstance(device, str) else device.type


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


_capability_cache: dict[str, frozenset[str]] = {}


def capabilities(device: str) -> frozenset[str]:
    """What the machine has for ops on `device`: for the CPU the usable instruction sets of the
    CPU record, "native" (the library loaded), "onednn" (PyTorch's packed linears) and
    "onednn_bf16"; for CUDA "cuda" and "triton" where importable."""
    found = _capability_cache.get(device)
    if found is not None:
        return found
    have: set[str] = set()
    if device == "cpu":
        from hybridkv.ops import native
        from hybridkv.ops.native import cpu

        rec = cpu.record()
        if native.library() is not None and not rec.native_loaded:
            cpu.record.cache_clear()  # (recorded while HYBRIDKV_NATIVE=0: record it again)
            rec = cpu.record()
        if native.library() is not None:  # (HYBRIDKV_NATIVE=0: none of the native kernels)
            have |= rec.usable
            have.add("native")
        mkldnn = getattr(torch.ops, "mkldnn", None)
        if torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise"):
            have.add("onednn")
            if rec.onednn_bf16:
                have.add("onednn_bf16")
    elif device == "cuda":
        have.add("cuda")
        try:
            importlib.import_module("triton")
            have.add("triton")
        except ImportError:
            pass
    _capability_cache[device] = found = frozenset(have)
    return found


def reset_all() -> None:
    """Forget every choice and the machine's capabilities (tests)."""
    _capability_cache.clear()
    for family in FAMILIES.values():
        family.reset()


def _import_declaring() -> None:
    for module in DECLARING_MODULES:
        importlib.import_module(module)


def table(device: str, dtypes: Iterable[str]) -> list[tuple[str, str, str]]:
    """(family, dtype, chosen chain or why none runs) for every declared family and dtype."""
    _import_declaring()
    rows = []
    for name in sorted(FAMILIES):
        for dtype in dtypes:
            try:
                text = FAMILIES[name].chain(device, dtype).describe()
            except OpError as e:
                text = f"none ({e})"
            rows.append((name, dtype, text))
    return rows


def format_table(rows: Iterable[tuple[str, str, str]]) -> str:
    """`table`'s rows (op, dtype, implementation) as aligned text with a header."""
    lines = [("op", "dtype", "implementation"), *rows]
    widths = [max(len(r[i]) for r in lines) for i in range(2)]
    return "\n".join(
        f"  {r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}".rstrip() for r in lines
    )

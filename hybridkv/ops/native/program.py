"""Record the native kernel calls of a function and replay them without Python (`program.c`).

A decode step at batch 1 makes about a hundred small calls (a norm of one 768-wide row, a
projection, a Mamba2 mixer ...). Each costs the interpreter, ctypes and tensor allocation
10-30 us on top of its work, and at batch 1 that adds up to a quarter of the step. When every
operation of the step is a native kernel, the step is fully described by the list of calls
with their argument values (pointers into fixed buffers, sizes, constants), and it can be made
again by a loop in C. This is what CUDA graphs do for GPU launches; `capture` is the CPU
equivalent:

    result, program, why_not = capture(lambda: model_step(static_inputs))
    ...                        # later steps: write new values into static_inputs in place,
    program.run()              # then the same calls on the same buffers, no Python between

`capture` runs the function once for real (its result is valid), recording every kernel call
(`native.Kernel` writes to the open tape) while a dispatch mode watches PyTorch: any op that
computes (anything but allocating or viewing memory) would not be replayed, so the capture is
refused (`program` None, `why_not` names the op) and the caller keeps running eagerly. Every
tensor allocated during the capture is kept by the program: the recorded pointers stay valid.
Programs that never run at the same time can share their allocations (`Arena`).
What the function does in Python (branches, sizes) is frozen: the caller replays a program only
for inputs of the shapes and kinds it was captured with.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridkv.ops import native

T = TypeVar("T")

# ATen ops that only allocate or describe memory: they may run during a capture (their results
# are kept); every other op computes something a replay would not redo.
NO_COMPUTE = frozenset({
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "alias", "slice", "select",
    "split", "split_with_sizes", "unbind", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "expand", "as_strided", "detach", "_reshape_alias", "narrow", "lift_fresh", "view_as",
    "chunk", "unflatten",
})  # fmt: skip


# Ops that return their input itself when it already is what they were asked for (`.to` of
# the tensor's own dtype, `.contiguous()` of a contiguous one, a reshape that is a view).
MAY_ALIAS = frozenset({"to", "contiguous", "reshape", "flatten", "type_as"})


def _aliases(out: object, args: tuple) -> bool:
    """Whether the op's result is its first argument's memory (nothing was computed)."""
    first = args[0] if args else None
    return (
        isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)
        and out.data_ptr() == first.data_ptr() and out.dtype == first.dtype
    )  # fmt: skip


class Tape:
    """The kernel calls recorded so far: (adapter index, argument values, kernel name)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int | float], str]] = []
        self.unreplayable: str | None = None  # why these calls cannot be replayed, if so

    def record(self, kernel: native.Kernel, args: tuple[Any, ...]) -> None:
        if kernel.index < 0:
            self.unreplayable = f"{kernel.name} has no replay adapter in this build"
            return
        values: list[int | float] = []
        for kind, value in zip(kernel.argtypes, args, strict=True):
            if kind is ctypes.c_float:
                values.append(float(value))
            elif value is None:
                values.append(0)
            elif isinstance(value, int):
                values.append(int(value))
            else:
                self.unreplayable = f"{kernel.name} got a {type(value).__name__} argument"
                return
        self.calls.append((kernel.index, values, kernel.name))


@contextlib.contextmanager
def recording() -> Iterator[Tape]:
    """Record every native kernel call made inside the block (one tape at a time)."""
    if native._tape is not None:
        raise RuntimeError("a tape is already recording")
    tape = Tape()
    native._tape = tape
    try:
        yield tape
    finally:
        native._tape = None


class Program:
    """Recorded calls, ready to run again in C. `keep`: the tensors whose memory they use."""

    def __init__(self, tape: Tape, lib: native.Library, keep: list[torch.Tensor]) -> None:
        n = len(tape.calls)
        self.kernel_names = [name for _, _, name in tape.calls]
        self._ops = (ctypes.c_int32 * n)(*(index for index, _, _ in tape.calls))
        starts, slots = [], []
        for _, values, _ in tape.calls:
            starts.append(len(slots))
            slots.extend(_slot(v) for v in values)
        self._starts = (ctypes.c_int64 * n)(*starts)
        self._args = (ctypes.c_int64 * max(1, len(slots)))(*slots)
        self._count = n
        self._run = lib.cdll.hkv_program_run
        self._run_timed = lib.cdll.hkv_program_run_timed
        args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._run.argtypes, self._run_timed.argtypes = args, [*args, ctypes.c_void_p]
        self._run.restype = self._run_timed.restype = ctypes.c_int64
        self.keep = keep
        # per call: nanoseconds spent in it over the replays run with profiling on
        self.profile: ctypes.Array | None = None

    def __len__(self) -> int:
        return self._count

    def run(self) -> None:
        if self.profile is None:
            failed = self._run(self._ops, self._starts, self._args, self._count)
        else:
            failed = self._run_timed(self._ops, self._starts, self._args, self._count, self.profile)
        if failed:
            raise RuntimeError(f"native kernel {self.kernel_names[failed - 1]} failed in replay")

    def start_profile(self) -> None:
        """Time every call of the replays from now on (`profiled` reads the totals)."""
        self.profile = (ctypes.c_int64 * self._count)()

    def profiled(self) -> list[tuple[str, float]]:
        """(kernel name, seconds) of each call, summed over the profiled replays."""
        assert self.profile is not None, "start_profile() first"
        return [(name, ns * 1e-9) for name, ns in zip(self.kernel_names, self.profile, strict=True)]


def _slot(value: int | float) -> int:
    """An argument slot (hkv_arg in program.c): an int as int64, a float as a double's bits."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return value


class Arena:
    """Memory for the tensors that captures allocate, shared by every program captured with
    it: programs that never run at the same time (a runner replays one decode step at a time)
    reuse the same bytes, so capturing 16 batch sizes costs the memory of the largest, and a
    replay's buffers lie close together. A capture takes its allocations one after the other
    from the start (`rewind`), in chunks of at least CHUNK_BYTES added as needed."""

    CHUNK_BYTES = 4 << 20
    ALIGN = 64  # bytes: a cache line, and any dtype's alignment

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.rewind()

    def rewind(self) -> None:
        self._chunk, self._offset = 0, 0

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of `like`'s shape, strides and dtype in the arena (contents undefined)."""
        span = 1 + sum((n - 1) * st for n, st in zip(like.shape, like.stride(), strict=True))
        size = like.element_size() * (span if like.numel() else 0)
        while True:
            if self._chunk == len(self.chunks):
                self.chunks.append(torch.empty(max(self.CHUNK_BYTES, size), dtype=torch.uint8))
            chunk = self.chunks[self._chunk]
            if self._offset + size <= chunk.numel():
                break
            self._chunk, self._offset = self._chunk + 1, 0
        raw = chunk[self._offset : self._offset + size]
        self._offset += -(-size // self.ALIGN) * self.ALIGN
        flat = raw.view(like.dtype) if size else torch.empty(0, dtype=like.dtype)
        return flat.as_strided(like.shape, like.stride())


ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like"})


def _on_cpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


class _ComputeWatch(TorchDispatchMode):
    """Keeps every tensor an op makes (allocations from the arena, if given), and the names of
    the ops that compute."""

    def __init__(self, arena: Arena | None) -> None:
        super().__init__()
        self.arena = arena
        self.keep: list[torch.Tensor] = []
        self.computed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        arena = self.arena
        if arena is not None and name in ALLOCATIONS and _on_cpu(out):
            out = arena.allocate(out)
        if name not in NO_COMPUTE and not (name in MAY_ALIAS and _aliases(out, args)):
            self.computed.append(str(func))
        self.keep.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def capture(
    fn: Callable[[], T], arena: Arena | None = None
) -> tuple[T, Program | None, str | None]:
    """Run fn once, recording its kernel calls: (its result, the program or None, why not).
    `arena`: where the tensors fn allocates live (shared with the programs captured before;
    only one of them may run at a time), else ordinary allocations."""
    lib = native.library()
    if lib is None:
        return fn(), None, "no native library"
    if arena is not None:
        arena.rewind()
    watch = _ComputeWatch(arena)
    with recording() as tape, watch:
        result = fn()
    if watch.computed:
        ops = ", ".join(dict.fromkeys(watch.computed))  # (each op once, in order)
        return result, None, f"computes outside native kernels: {ops}"
    if tape.unreplayable is not None:
        return result, None, tape.unreplayable
    if not tape.calls:
        return result, None, "no native kernel calls"
    return result, Program(tape, lib, watch.keep), None

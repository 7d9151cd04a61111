"""Where a Mamba2 layer's ops run: one class per declared backend (`layers.mamba2.MAMBA2_OPS`).

The plan chooses one per state group from the declaration (platform, dtypes, what the machine
has); the runner instantiates it and binds it to the group's layers. Each class is one fixed
route, never a chain of attempts:

    backend    causal conv1d                       scan
    torch      PyTorch (ops.conv1d)                PyTorch chunked SSD + one-step (ops.mamba2)
    native     C kernel, state in place            C kernel, state in place (ops.native); with
                                                   the gated norm, the whole mixer in one call
                                                   (`fused_mix`)
    triton     Triton for decode steps, else torch  Triton for one-token requests, else torch
    compiled   PyTorch                             torch.compile'd decode step when every
                                                   request decodes from a state, else torch

Every method takes a `StateMetadata` (pages, has-initial flags, packed query bounds) and updates
the paged state in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops.conv1d import activate, causal_conv1d_varlen, is_decode
from hybridkv.ops.elementwise import to_dtype
from hybridkv.ops.mamba2 import decode_in_place, mamba2_scan_varlen, scan_inputs
from hybridkv.ops.native import ssm as native_ssm
from hybridkv.ops.positions import run_keeping_positions


class ScanParams(NamedTuple):
    """A Mamba2 layer's constants for the scan."""

    A: torch.Tensor  # [H] negative
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    chunk_size: int  # tokens per chunk of the PyTorch chunked scan
    dt_limit: tuple[float, float]


class NormArgs(NamedTuple):
    """A Mamba2 layer's gated RMSNorm (`ops.norm.gated_rms_norm`'s arguments)."""

    weight: torch.Tensor  # [I]
    group_size: int
    eps: float
    norm_before_gate: bool
    weight_in_fp32: bool


# speculative decoding's per-position states of a step (`StateMetadata.scratch_rows`): the
# layer's (conv scratch, ssm scratch), each [scratch rows, positions, *state shape]
PositionScratch = tuple[torch.Tensor, torch.Tensor]


class TorchMamba2Ops:
    """The PyTorch reference ops (any platform, any dtype)."""

    name = "torch"
    # whether these ops keep the state after every position of a request's chunk where the step
    # asks (`StateMetadata.scratch_rows`): speculative decoding then commits the accepted
    # position's state instead of rewinding the request (docs/speculative-decoding.md). Here:
    # such requests run one token at a time through the op (`ops.positions`)
    keeps_positions = True

    def fused_mix(
        self,
        zxbcdt: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: ScanParams,
        norm: NormArgs,
        n_groups: int,
        positions: PositionScratch | None = None,
    ) -> torch.Tensor | None:
        """The whole mixer between its projections in one call (conv + silu, dt, scan, gated
        norm; states in place) -> [T, I] in zxbcdt's dtype, where a backend offers it; None
        here: the layer runs the ops one by one."""
        return None

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        activation: str | None,
        out_dtype: torch.dtype | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, C]; weight: [C, K]; conv_state: [num_pages, C, K-1] -> [T, C] in `out_dtype`
        (default x.dtype; the Mamba2 mixer asks for float32, what its scan computes in).
        `positions` ([rows, positions, C, K-1]): keep the state after every position where
        `meta.scratch_rows` says (in PyTorch: gathered from the inputs after the conv)."""
        histories = None if positions is None else conv_histories(conv_state, meta)
        y = causal_conv1d_varlen(
            x, weight, bias, conv_state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc, meta.max_query_len, activation,
        )  # fmt: skip
        if positions is not None:
            assert histories is not None
            keep_conv_positions(x, histories, positions)
        return y if out_dtype is None else y.to(out_dtype)

    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: ScanParams,
        out_dtype: torch.dtype,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, H, P]; dt: [T, H] raw; B, C: [T, G, N]; ssm_state: [num_pages, H, P, N]
        -> y: [T, H, P] in out_dtype (see `ops.mamba2.mamba2_scan_varlen`). `positions`
        ([rows, positions, H, P, N]): as in `conv1d`."""
        if positions is not None:
            return run_keeping_positions(
                (x, dt, B, C), meta, ssm_state, positions,
                lambda t, m: self.scan(*t, ssm_state, m, p, out_dtype),
            )  # fmt: skip
        return mamba2_scan_varlen(
            x, dt, p.A, B, C, p.D, p.dt_bias, ssm_state, meta.state_pages,
            meta.has_initial_state, meta.query_start_loc, meta.max_query_len, p.chunk_size,
            p.dt_limit, out_dtype, self.decode_rows(),
        )  # fmt: skip

    def decode_rows(self) -> Callable[..., torch.Tensor] | None:
        """A kernel for the one-token requests of a scan (None: the PyTorch recurrence)."""
        return None


class NativeMamba2Ops(TorchMamba2Ops):
    """The C kernels of `hybridkv.ops.native` (CPU; float32 or bfloat16 states, float32 math; conv
    history up to `native_ssm.CONV_MAX_HISTORY` columns, which the layer's declaration checks)."""

    name = "native"

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        activation: str | None,
        out_dtype: torch.dtype | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As TorchMamba2Ops.conv1d. The kernel computes in float32 and, for bfloat16 x,
        rounds its result to bfloat16 values (after silu), the numbers the model gives in its
        dtype: a float32 `out_dtype` takes them without a bfloat16 tensor to widen again, a
        bfloat16 one gets them narrowed exactly by a native kernel (`to_dtype`)."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if x.shape[0] == 0:
            return x.new_empty(x.shape, dtype=out_dtype)
        fused = activation in ("silu", "swish")  # the kernel applies silu itself
        y = native_ssm.conv1d(
            x, weight, bias, conv_state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc, fused, x.dtype == torch.bfloat16,
            kept_rows(positions, meta),
        )  # fmt: skip
        if y is None:
            raise RuntimeError(_declined("conv1d", x, conv_state))
        return to_dtype(y if fused else activate(y, activation), out_dtype)

    def fused_mix(
        self,
        zxbcdt: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: ScanParams,
        norm: NormArgs,
        n_groups: int,
        positions: PositionScratch | None = None,
    ) -> torch.Tensor | None:
        """One native call (`native_ssm.mamba2_mix`): the kernels the separate ops run, with their
        numbers, without the small tensor ops and checks between them."""
        kept = None
        if positions is not None:
            assert meta.scratch_rows is not None
            kept = (*positions, meta.scratch_rows)
        y = native_ssm.mamba2_mix(
            zxbcdt, conv_weight, conv_bias, conv_state, ssm_state, meta.state_pages,
            meta.has_initial_state, meta.query_start_loc, (p.A, p.D, p.dt_bias, p.dt_limit),
            tuple(norm), n_groups, zxbcdt.dtype, kept,
        )  # fmt: skip
        if y is None:
            raise RuntimeError(_declined("mamba2 mixer", zxbcdt, ssm_state))
        return y

    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: ScanParams,
        out_dtype: torch.dtype,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(x.shape, dtype=out_dtype)
        f = scan_inputs(x, dt, p.A, B, C, p.D, p.dt_bias, p.dt_limit)
        y = native_ssm.mamba2_scan(
            ssm_state, meta.state_pages, meta.has_initial_state, meta.query_start_loc, *f,
            positions=kept_rows(positions, meta),
        )
        if y is None:
            raise RuntimeError(_declined("mamba2 scan", x, ssm_state))
        return y.to(out_dtype)


def conv_histories(
    conv_state: torch.Tensor, meta: StateMetadata
) -> list[tuple[int, int, int, torch.Tensor]]:
    """(scratch row, first token, tokens, its conv state before the step [C, K-1]) of every
    request with a scratch row (read before the conv overwrites its page; zeros without an
    initial state)."""
    assert meta.scratch_rows is not None
    bounds = meta.query_start_loc.tolist()
    pages, has = meta.state_pages.tolist(), meta.has_initial_state.tolist()
    out = []
    for s, row in enumerate(meta.scratch_rows.tolist()):
        if row >= 0:
            page = conv_state[pages[s]]
            history = page.clone() if has[s] else torch.zeros_like(page)
            out.append((row, bounds[s], bounds[s + 1] - bounds[s], history))
    return out


def keep_conv_positions(
    x: torch.Tensor, histories: list[tuple[int, int, int, torch.Tensor]], kept: torch.Tensor
) -> None:
    """The conv state after each of those requests' tokens but its last into `kept` ([rows,
    positions, C, K-1]): its last K - 1 inputs.

        seen = [ history (K-1 columns) | x_0 .. x_{n-1} ]      state after token i: the
                                                               K-1 columns ending at x_i
    """
    for row, first, n, history in histories:
        seen = torch.cat([history, x[first : first + n].t().to(history.dtype)], dim=1)
        windows = seen.unfold(1, history.shape[1], 1)  # [C, n + 1, K-1]: window j starts at j
        kept[row, : n - 1] = windows[:, 1:n].transpose(0, 1)


def kept_rows(
    scratch: torch.Tensor | None, meta: StateMetadata
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scratch, rows) for a native kernel. The caller (the model runner) makes sure a request
    with a row has at most scratch.shape[1] + 1 tokens: a kernel's checks here are a few ints,
    never tensor ops (captured steps replay native calls only)."""
    if scratch is None:
        return None
    assert meta.scratch_rows is not None
    return scratch, meta.scratch_rows


def _declined(op: str, x: torch.Tensor, state: torch.Tensor) -> str:
    return (
        f"the native {op} kernel declined {x.dtype} input with a {state.dtype} state on "
        f"{x.device}: the plan should not have chosen native ops for this layer"
    )


class TritonMamba2Ops(TorchMamba2Ops):
    """GPUs: the decode steps in Triton (each state read and written once, in its page);
    prefill chunks in PyTorch."""

    name = "triton"

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        activation: str | None,
        out_dtype: torch.dtype | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if is_decode(meta.max_query_len, x.shape[0], meta.state_pages):  # (no position to keep)
            from hybridkv.ops import triton_mamba

            y = triton_mamba.conv1d_decode(
                x, weight, bias, conv_state, meta.state_pages, meta.has_initial_state, activation
            )
            return y if out_dtype is None else y.to(out_dtype)
        return super().conv1d(x, weight, bias, conv_state, meta, activation, out_dtype, positions)

    def decode_rows(self) -> Callable[..., torch.Tensor]:
        from hybridkv.ops import triton_mamba

        return triton_mamba.ssm_decode


class CompiledMamba2Ops(TorchMamba2Ops):
    """PyTorch with a torch.compile'd decode step (`ModelConfig.compile`, where the native
    kernels are not chosen: no C compiler, or bf16 states). Compiled once per process, on the
    first decode step."""

    name = "compiled"
    _step: Callable[..., torch.Tensor] | None = None

    @classmethod
    def _compiled(cls) -> Callable[..., torch.Tensor]:
        if cls._step is None:
            cls._step = torch.compile(decode_in_place, dynamic=True)
        return cls._step

    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: ScanParams,
        out_dtype: torch.dtype,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decoding = is_decode(meta.max_query_len, x.shape[0], meta.state_pages)
        if positions is None and decoding and x.shape[0] > 0 and bool(meta.has_initial_state.all()):
            f = scan_inputs(x, dt, p.A, B, C, p.D, p.dt_bias, p.dt_limit)
            # the request count as a size unknown at compile time, so that one graph serves
            # every batch (a size the compiler may see as 1 gets a graph of its own: a second
            # compile, ~2.5 s, the first time a single request decodes)
            from torch._dynamo.decorators import mark_unbacked  # (imported with torch.compile)

            for t in (meta.state_pages, f.x, f.dt, f.B, f.C):  # [R, ...] each
                mark_unbacked(t, 0)
            return self._compiled()(ssm_state, meta.state_pages, *f).to(out_dtype)
        return super().scan(x, dt, B, C, ssm_state, meta, p, out_dtype, positions)

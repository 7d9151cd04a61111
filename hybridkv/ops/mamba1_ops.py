"""Where a Mamba1 layer's ops run: one class per declared backend (`layers.mamba1.MAMBA1_OPS`),
chosen by the plan.

A layer needs two ops: the causal conv1d over x (the same op as Mamba2's, on a conv state
[Di, d_conv - 1] of the same layout, so each class takes its conv from the Mamba2 ops class of
the same backend) and the selective scan:

    backend    causal conv1d                        selective scan
    torch      PyTorch (ops.conv1d)                 PyTorch token walk (ops.mamba1)
    native     C kernel, state in place, for        C kernel, state in place
               float32 activations, weight and      (ops.native.ssm): float32 or
               state; PyTorch for bfloat16 ones     bfloat16 inputs and state, float32 math
    triton     Triton decode step (Mamba2's),       Triton decode step for one-token requests
               PyTorch for prefill chunks           (ops.triton_mamba1), PyTorch for prefill

Every method takes a `StateMetadata` (pages, has-initial flags, packed query bounds) and updates
the paged state in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops.elementwise import to_dtype
from hybridkv.ops.mamba1 import DecodeRows, mamba1_scan_varlen
from hybridkv.ops.mamba2_ops import (
    NativeMamba2Ops,
    TorchMamba2Ops,
    TritonMamba2Ops,
    kept_rows,
)
from hybridkv.ops.native import ssm as native_ssm
from hybridkv.ops.positions import run_keeping_positions


class Mamba1Params(NamedTuple):
    """A Mamba1 layer's constants for the scan."""

    A: torch.Tensor  # [Di, N] float32, negative (-exp(A_log))
    D: torch.Tensor | None  # [Di]
    dt_bias: torch.Tensor | None  # [Di] (dt_proj.bias)


class TorchMamba1Ops:
    """The PyTorch reference ops (any platform, any dtype)."""

    name = "torch"
    # the state after every position of a speculating request is kept
    # (`TorchMamba2Ops.keeps_positions`; here one token at a time: `ops.positions`)
    keeps_positions = True
    _conv = TorchMamba2Ops()

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        activation: str | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, Di]; weight: [Di, d_conv]; conv_state: [num_pages, Di, d_conv - 1]
        -> [T, Di] in x.dtype (see `ops.conv1d.causal_conv1d_varlen`). `positions`: as
        `TorchMamba2Ops.conv1d`'s."""
        return self._conv.conv1d(x, weight, bias, conv_state, meta, activation, None, positions)

    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        z: torch.Tensor | None,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: Mamba1Params,
        out_dtype: torch.dtype,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x, dt (raw), z: [T, Di]; B, C: [T, N]; ssm_state: [num_pages, Di, N] -> y [T, Di]
        in out_dtype (see `ops.mamba1.mamba1_scan_varlen`). `positions` ([rows, positions, Di,
        N]): keep the state after every position (`ops.positions`)."""
        if positions is not None:
            return run_keeping_positions(
                (x, dt, B, C, z), meta, ssm_state, positions,
                lambda t, m: self.scan(*t, ssm_state, m, p, out_dtype),
            )  # fmt: skip
        return mamba1_scan_varlen(
            x, dt, p.A, B, C, p.D, z, p.dt_bias, ssm_state, meta.state_pages,
            meta.has_initial_state, meta.query_start_loc, meta.max_query_len, out_dtype,
            self.decode_rows(),
        )  # fmt: skip

    def decode_rows(self) -> DecodeRows | None:
        """A kernel for the one-token requests of a scan (None: the PyTorch step)."""
        return None


class NativeMamba1Ops(TorchMamba1Ops):
    """The C kernels of `hybridkv.ops.native` (CPU). The scan runs natively for float32 and
    bfloat16 inputs and states (`layers.mamba1.MAMBA1_OPS` declares both); the conv1d natively
    where its kernel applies (float32 or bfloat16 activations, weight and conv state of one
    dtype, at most `native_ssm.CONV_MAX_HISTORY` history columns; bfloat16: float32 math, the
    result rounded once), else in PyTorch. The route is fixed by the layer's dtypes and width,
    never a fallback after a kernel declined."""

    name = "native"
    _native_conv = NativeMamba2Ops()

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        activation: str | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dtypes = {t.dtype for t in (x, weight, conv_state)}
        same = len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16}
        if same and weight.shape[-1] - 1 <= native_ssm.CONV_MAX_HISTORY:
            return self._native_conv.conv1d(
                x, weight, bias, conv_state, meta, activation, None, positions
            )
        return super().conv1d(x, weight, bias, conv_state, meta, activation, positions)

    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        z: torch.Tensor | None,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        p: Mamba1Params,
        out_dtype: torch.dtype,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y = native_ssm.mamba1_scan(
            x, dt, p.A, B, C, p.D, z, p.dt_bias, ssm_state, meta.state_pages,
            meta.has_initial_state, meta.query_start_loc, kept_rows(positions, meta),
        )  # fmt: skip
        if y is None:
            raise RuntimeError(
                f"the native mamba1 scan kernel declined {x.dtype} input with a "
                f"{ssm_state.dtype} state on {x.device}: the plan should not have chosen "
                "native ops for this layer"
            )
        return to_dtype(y, out_dtype)


class TritonMamba1Ops(TorchMamba1Ops):
    """GPUs: the conv1d's decode steps (Mamba2's Triton kernel) and the scan's one-token
    requests (`ops.triton_mamba1`) in Triton, each state read and written once in its page;
    prefill chunks in PyTorch."""

    name = "triton"
    _triton_conv = TritonMamba2Ops()

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        activation: str | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._triton_conv.conv1d(
            x, weight, bias, conv_state, meta, activation, None, positions
        )

    def decode_rows(self) -> DecodeRows:
        from hybridkv.ops import triton_mamba1

        return triton_mamba1.mamba1_decode

"""Where a KDA layer's ops run: one class per declared backend (`layers.kda.KDA_OPS`), chosen by
the plan.

A KDA layer needs two ops: the causal conv1d of q, k and v (three calls, each with its own conv
state; the Mamba2 conv1d of the same backend) and the KDA rule (`ops.kda`):

    backend    causal conv1d                        KDA rule
    torch      PyTorch (ops.conv1d)                 PyTorch chunked form + recurrence (ops.kda)
    native     C kernel for float32 activations,    C kernel (ops/native/kda.c), token by
               weight and state; else PyTorch       token, state in place; float32 or bfloat16
    triton     Triton decode step (Mamba2's),       Triton decode step (ops.triton_kda) for
               PyTorch for prefill chunks           one-token requests, PyTorch chunked prefill
"""

from __future__ import annotations

import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops.gdn_ops import native_conv_applies
from hybridkv.ops.kda import KdaDecodeRows, kda_varlen
from hybridkv.ops.mamba2_ops import (
    NativeMamba2Ops,
    TorchMamba2Ops,
    TritonMamba2Ops,
    _declined,
    kept_rows,
)
from hybridkv.ops.positions import run_keeping_positions


class TorchKdaOps(TorchMamba2Ops):
    """The PyTorch reference ops (any platform, any dtype)."""

    name = "torch"
    chunk_size = 32

    def rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta: StateMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q, k: [T, H, K] (raw); v: [T, H, V]; g: [T, H, K], beta: [T, H] float32; state:
        [num_pages, H, K, V] -> o [T, H, V] float32 (see `ops.kda`). `positions` ([rows,
        positions, H, K, V]): keep the state after every position (`ops.positions`)."""
        if positions is not None:
            return run_keeping_positions(
                (q, k, v, g, beta), meta, state, positions,
                lambda t, m: self.rule(*t, state, m),
            )  # fmt: skip
        return kda_varlen(
            q, k, v, g, beta, state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc, meta.max_query_len, self.chunk_size, self.rule_decode(),
        )  # fmt: skip

    def rule_decode(self) -> KdaDecodeRows | None:
        """A kernel for the one-token requests (None: the PyTorch recurrence)."""
        return None


class NativeKdaOps(NativeMamba2Ops, TorchKdaOps):
    """The C kernels (CPU). The rule runs natively for float32 and bfloat16 inputs and states;
    the conv1d natively where its kernel applies (float32 activations, weight and conv state, a
    short enough history), else in PyTorch: a route fixed per layer by its dtypes, never a
    fallback after a kernel declined."""

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
        args = (x, weight, bias, conv_state, meta, activation, out_dtype, positions)
        if native_conv_applies(x, weight, conv_state):
            return super().conv1d(*args)
        return TorchMamba2Ops.conv1d(self, *args)

    def rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta: StateMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from hybridkv.ops.native import kda as native_kda

        o = native_kda.kda_rule(
            q, k, v, g, beta, state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc, kept_rows(positions, meta),
        )  # fmt: skip
        if o is None:
            raise RuntimeError(_declined("KDA rule", v, state))
        return o


class TritonKdaOps(TritonMamba2Ops, TorchKdaOps):
    """GPUs: the conv1d's decode steps (Mamba2's Triton kernel) and the rule's one-token requests
    in Triton (`ops.triton_kda`); prefill chunks in the PyTorch chunked form."""

    name = "triton"

    def rule_decode(self) -> KdaDecodeRows | None:
        from hybridkv.ops import triton_kda

        return triton_kda.kda_decode

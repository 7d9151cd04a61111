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
    fla        as triton                            as triton for one-token requests; prefill
                                                    chunks through flash-linear-attention's
                                                    chunked kernel (`fla-core`, when installed:
                                                    fla.ops.kda.chunk_kda), bf16 / fp16
"""

from __future__ import annotations

import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops.fla_varlen import FlaPrefill
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


class FlaKdaOps(FlaPrefill, TritonKdaOps):
    """GPUs with flash-linear-attention installed: prefill chunks through its chunked KDA kernel
    (`fla.ops.kda.chunk_kda`), one-token requests (and the verify chunks of speculating
    requests, one token at a time) through hybridkv's Triton decode kernel in the pages (the
    routing: `ops.fla_varlen`). bfloat16 / float16 compute only: the kernel's matrix products
    round float32 inputs to TF32.

    The mapping onto fla's arguments (`fla_chunk`), for the rule of `ops.kda`:

        hybridkv (TorchKdaOps.rule)                fla chunk_kda
        q, k [T, H, K] raw (conv outputs)          q, k [1, n, H, K], use_qk_l2norm_in_kernel:
          L2-normalised, x / sqrt(sum x^2 + 1e-6)    the same norm, eps 1e-6
          q times 1/sqrt(K) after the norm           scale = K ** -0.5 (passed: its default)
        v [T, H, V]                                v [1, n, H, V] (HV = H: no grouped values)
        g [T, H, K] float32, the log decay per     g [1, n, H, K], use_gate_in_kernel=False: a
          key channel, already formed:               log-space decay the kernel only sums
          -exp(A_log) * softplus(f + dt_bias)        within chunks (True would take f, A_log
          (`kda_gate`, before the op, as             and dt_bias and form that gate in the
          transformers forms it)                     kernel; the layer's op is given g)
        beta [T, H] float32, sigmoid applied       beta [1, n, H], use_beta_sigmoid_in_kernel
                                                     False: taken as it is
        S [num_pages, H, K, V]: decays by rows,    initial_state / final state [N, H, K, V]
          o = S^T q                                  float32, state_v_first=False: the same
                                                     [K, V] layout, no transpose
        o [T, H, V] float32                        o [1, n, H, V] in q's dtype (bf16), widened
                                                     (the layer rounds o to the model's dtype
                                                     next, as transformers does)

    fla's FlashKDA backend (CUTLASS, where `flash_kda` is installed) takes only calls with the
    gate and beta's sigmoid in its kernel, a bounded gate and a V-first state; with these flags
    fla runs its Triton kernels.
    """

    name = "fla"

    @staticmethod
    def fla_chunk(
        inputs: tuple[torch.Tensor, ...], h0: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's `chunk_kda` on the packed q, k [1, n, H, K], v [1, n, H, V], g [1, n, H, K],
        beta [1, n, H] (the mapping above) -> (o [1, n, H, V], final states [N, H, K, V])."""
        from fla.ops.kda import chunk_kda

        q, k, v, g, beta = inputs
        return chunk_kda(
            q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False, state_v_first=False, cu_seqlens=cu_seqlens,
        )  # fmt: skip

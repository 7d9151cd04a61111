"""Where a gated-delta-net layer's ops run: one class per declared backend
(`layers.gated_delta_net.GDN_OPS`), chosen by the plan.

A layer needs two ops: the causal conv1d over [q | k | v] (the same op as Mamba2's, so each class
takes its conv from the Mamba2 ops class of the same backend) and the gated delta rule:

    backend    causal conv1d                        gated delta rule
    torch      PyTorch (ops.conv1d)                 PyTorch chunked form + recurrence
                                                    (ops.gated_delta)
    native     C kernel, state in place, float32    C kernel, token by token, state in place
               math on float32 or bfloat16          (ops.native.gdn): float32 or
               activations, weight and state        bfloat16 q/k/v and state, float32 math;
                                                    one-token requests: one pass per state
                                                    (ops.native.gdn_decode); longer ones with
                                                    bfloat16 q/k/v: chunks of 64 on AMX
                                                    (ops.native.gdn_chunk)
    triton     Triton decode step (Mamba2's),       Triton decode step for one-token requests
               PyTorch for prefill chunks           (ops.triton_gdn), PyTorch chunked form for
                                                    prefill chunks
    fla        as triton                            as triton for one-token requests; prefill
                                                    chunks through flash-linear-attention's
                                                    chunked kernel (`fla-core`, when installed:
                                                    fla.ops.gated_delta_rule), bf16 / fp16
"""

from __future__ import annotations

import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops.derived import derived
from hybridkv.ops.fla_varlen import FlaPrefill
from hybridkv.ops.gated_delta import DecodeRows, gated_delta_rule_varlen
from hybridkv.ops.mamba2_ops import (
    NativeMamba2Ops,
    TorchMamba2Ops,
    TritonMamba2Ops,
    _declined,
    kept_rows,
)
from hybridkv.ops.native import gdn as native_gdn
from hybridkv.ops.native import gdn_chunk as native_gdn_chunk
from hybridkv.ops.native import gdn_decode as native_gdn_decode
from hybridkv.ops.native import ssm as native_ssm
from hybridkv.ops.native.common import FLOAT_DTYPES
from hybridkv.ops.positions import run_keeping_positions


class TorchGDNOps(TorchMamba2Ops):
    """The PyTorch reference ops (any platform, any dtype)."""

    name = "torch"
    chunk_size = 64

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
        """q, k: [T, Hk, K] (raw); v: [T, Hv, V]; g, beta: [T, Hv] float32; state:
        [num_pages, Hv, K, V] -> o [T, Hv, V] float32 (see `ops.gated_delta`). `positions`
        ([rows, positions, Hv, K, V]): keep the state after every position (`ops.positions`)."""
        if positions is not None:
            return run_keeping_positions(
                (q, k, v, g, beta), meta, state, positions,
                lambda t, m: self.rule(*t, state, m),
            )  # fmt: skip
        return gated_delta_rule_varlen(
            q, k, v, g, beta, state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc, meta.max_query_len, self.chunk_size, self.rule_decode(),
        )  # fmt: skip

    def rule_decode(self) -> DecodeRows | None:
        """A kernel for the one-token requests (None: the PyTorch recurrence)."""
        return None


class NativeGDNOps(NativeMamba2Ops, TorchGDNOps):
    """The C kernels of `hybridkv.ops.native` (CPU). The gated delta rule runs natively for
    float32 and bfloat16 inputs and states (`layers.gated_delta_net.GDN_OPS` declares both);
    a step whose requests all have one token takes the decode kernel (`native_gdn_decode`: each
    state read from memory once, 1.9x the general kernel's speed at 64 requests), and with
    bfloat16 q, k, v the longer requests take the chunked form on AMX (`native_gdn_chunk`, 2.5x
    on prefill chunks; a mixed step's one-token requests then go to the decode kernel). The
    conv1d runs natively where its kernel applies (float32 or bfloat16 activations, weight and
    conv state, at most `native_ssm.CONV_MAX_HISTORY` history columns), else in PyTorch: the
    route is fixed per layer by its dtypes and width, never a fallback after a kernel
    declined. A verify step's speculating requests (per-position states) run token by token in
    the general kernel, which copies each state."""

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
        """As NativeMamba2Ops.conv1d; `layers.gated_delta_net` asks for float32 results (of
        bfloat16 values for bfloat16 x), which the rule kernels read as they are."""
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
        spans = (meta.state_pages, meta.has_initial_state, meta.query_start_loc)
        if positions is not None:  # a verify step: token by token, every position kept
            o = native_gdn.gated_delta_rule(
                q, k, v, g, beta, state, *spans, positions=kept_rows(positions, meta)
            )
            if o is None:
                raise RuntimeError(_declined("gated delta rule", v, state))
            return o
        if meta.max_query_len == 1:  # one token per request: the one-pass decode kernel
            o = native_gdn_decode.gdn_decode(q, k, v, g, beta, state, *spans)
            if o is not None:
                return o
        elif native_gdn_chunk.applies(q, v, state):  # bfloat16 q, k, v: AMX chunks
            o = native_gdn_chunk.gdn_chunk(q, k, v, g, beta, state, *spans)
            if o is not None:  # (its one-token requests: the decode kernel, into the same o)
                if native_gdn_decode.gdn_decode(q, k, v, g, beta, state, *spans, out=o) is None:
                    raise RuntimeError(_declined("gated delta rule", v, state))
                return o
        o = native_gdn.gated_delta_rule(
            q, k, v, g, beta, state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc,
        )  # fmt: skip
        if o is None:
            raise RuntimeError(_declined("gated delta rule", v, state))
        return o

    def rule_norm(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta: StateMetadata,
        z: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor | None:
        """A decode step's rule and then Qwen3-Next's gated norm (`ops.norm.gated_rms_norm` of
        bf16(o) with z, norm first) in the decode kernel, each head's o normed while in cache:
        z [T, Hv * V] bfloat16 -> y [T, Hv * V] bfloat16; None for other steps or tensors (the
        layer then runs `rule` and the norm)."""
        if meta.max_query_len != 1:
            return None
        w = derived(weight, "f32", lambda t: t.float().contiguous())
        spans = (meta.state_pages, meta.has_initial_state, meta.query_start_loc)
        return native_gdn_decode.gdn_decode(q, k, v, g, beta, state, *spans, norm=(z, w, eps))


class TritonGDNOps(TritonMamba2Ops, TorchGDNOps):
    """GPUs: the conv1d's decode steps (Mamba2's Triton kernel) and the rule's one-token
    requests in Triton, each state read and written once in its page; prefill chunks in the
    PyTorch chunked form (`ops.gated_delta`), which batches them into matrix products."""

    name = "triton"

    def rule_decode(self) -> DecodeRows | None:
        from hybridkv.ops import triton_gdn

        return triton_gdn.gdn_decode


class FlaGDNOps(FlaPrefill, TritonGDNOps):
    """GPUs with flash-linear-attention installed: prefill chunks through its chunked kernel
    (`chunk_gated_delta_rule`, the one vLLM and SGLang run), which on an H200 at Qwen3-Next's
    sizes took 0.04 to 0.26 of the PyTorch chunked form's time; one-token requests (and the
    verify chunks of speculating requests, one token at a time) through hybridkv's Triton decode
    kernel, which reads and writes each state in its page (the routing: `ops.fla_varlen`).
    bfloat16 / float16 compute only: the kernel's matrix products round float32 inputs to
    TF32."""

    name = "fla"

    @staticmethod
    def fla_chunk(
        inputs: tuple[torch.Tensor, ...], h0: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's `chunk_gated_delta_rule` on the packed q, k [1, n, Hk, K] (L2-normalised in the
        kernel, q scaled by its default 1/sqrt(K)), v [1, n, Hv, V], g, beta [1, n, Hv]: the
        rule of `ops.gated_delta`, states [N, Hv, K, V] as hybridkv's pages."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v, g, beta = inputs
        return chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip


def native_conv_applies(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> bool:
    """Whether the native conv1d kernel takes these tensors (float32 or bfloat16 each, widened
    as read; a short enough history)."""
    floats = all(t.dtype in FLOAT_DTYPES for t in (x, weight, conv_state))
    return floats and weight.shape[-1] - 1 <= native_ssm.CONV_MAX_HISTORY

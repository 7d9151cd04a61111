"""Where a gated-delta-net layer's ops run: one class per declared backend
(`layers.gated_delta_net.GDN_OPS`), chosen by the plan.

A layer needs two ops: the causal conv1d over [q | k | v] (the same op as Mamba2's, so each class
takes its conv from the Mamba2 ops class of the same backend) and the gated delta rule:

    backend    causal conv1d                        gated delta rule
    torch      PyTorch (ops.conv1d)                 PyTorch chunked form + recurrence
                                                    (ops.gated_delta)
"""

from __future__ import annotations

import torch

from hybridkv.layers.state_base import StateMetadata
from hybridkv.ops.gated_delta import DecodeRows, gated_delta_rule_varlen
from hybridkv.ops.mamba2_ops import TorchMamba2Ops


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
    ) -> torch.Tensor:
        """q, k: [T, Hk, K] (raw); v: [T, Hv, V]; g, beta: [T, Hv] float32; state:
        [num_pages, Hv, K, V] -> o [T, Hv, V] float32 (see `ops.gated_delta`)."""
        return gated_delta_rule_varlen(
            q, k, v, g, beta, state, meta.state_pages, meta.has_initial_state,
            meta.query_start_loc, meta.max_query_len, self.chunk_size, self.rule_decode(),
        )  # fmt: skip

    def rule_decode(self) -> DecodeRows | None:
        """A kernel for the one-token requests (None: the PyTorch recurrence)."""
        return None

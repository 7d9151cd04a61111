"""State mixers bound to their pages of the state cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.worker.batch import ForwardBatch


class PagedMamba2Mixer(Mamba2Mixer):
    """A `Mamba2Mixer` that finds its running states through the step's `ForwardBatch`."""

    def __init__(self, layer_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layer_name = layer_name
        self.state_views: Mapping[str, torch.Tensor] | None = None

    def bind(self, views: Mapping[str, torch.Tensor], backend: object = None) -> None:
        # views["conv"]: [num_pages, conv_dim, d_conv - 1]; views["ssm"]: [num_pages, H, P, N]
        self.state_views = views

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # type: ignore[override]
        assert self.state_views is not None, "state cache not bound"
        meta = batch.state_for(self.layer_name)
        return super().forward(
            hidden_states, self.state_views["conv"], self.state_views["ssm"], meta
        )

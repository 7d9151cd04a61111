"""Helpers of the per-position state tests: a layer's projections recorded over a whole step
and replayed for a prefix of its tokens, so that a prefix run differs from the step only in the
state ops (a linear of fewer rows may round differently)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hybridkv.forward_batch import StateMetadata


def with_scratch_rows(meta: StateMetadata, rows: list[int]) -> StateMetadata:
    """The metadata with each request's scratch row (-1: none)."""
    return StateMetadata(**{**meta.__dict__, "scratch_rows": torch.tensor(rows)})


def recording_linears(module: torch.nn.Module, run: Callable[[], Any]) -> tuple[Any, dict]:
    """run() with every nn.Linear of `module` recording its output -> (run's result, linear ->
    its [tokens, out] output)."""
    outputs: dict[torch.nn.Module, torch.Tensor] = {}
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    def keep(m: torch.nn.Module, _: Any, out: torch.Tensor) -> None:
        outputs[m] = out

    hooks = [m.register_forward_hook(keep) for m in linears]
    try:
        return run(), outputs
    finally:
        for hook in hooks:
            hook.remove()


@contextmanager
def replaying(outputs: dict, first: int, end: int) -> Iterator[None]:
    """Each recorded linear returns its rows first .. end - 1 of the recorded step."""
    for m in outputs:
        m.forward = lambda _, m=m: outputs[m][first:end]
    try:
        yield
    finally:
        for m in outputs:
            del m.forward

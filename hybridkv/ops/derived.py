"""Values derived from a weight, computed once and kept until the weight changes.

A decode step calls each layer's ops with the same weights every time, and some ops want them
in another form (-exp(A_log), a transposed float32 conv weight, a float32 norm weight for
bfloat16 rows). Recomputing those is a handful of small ops per layer and step, which at batch
1 costs as much as the arithmetic. `derived` keeps the form on the weight tensor itself (its
base, for a view), keyed by what it is and by the view's geometry, and recomputes it when the
tensor's version counter moves (any in-place write: loading, `copy_`, an optimiser step) or its
storage changes (`param.data = ...`), so a cached value is never stale and is freed with the
weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_ATTR = "_hybridkv_derived"


def derived(t: torch.Tensor, what: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(t), cached on t until t (or the tensor it views) is written in place or given new
    storage (`param.data = ...`, as `module.to(dtype)` does)."""
    base = t._base
    owner = t if base is None else base
    # a view's form depends on which part of its base it shows
    key = what if base is None else (what, t.storage_offset(), tuple(t.shape), t.stride())
    table = owner.__dict__.get(_ATTR)
    if table is not None:
        hit = table.get(key)
        if hit is not None and hit[0] == t._version and hit[1] == t.data_ptr():
            return hit[2]
    if t.is_inference():  # (no version counter to tell a change by: compute every time)
        return fn(t)
    value = fn(t)
    if value is not t:  # (nothing to keep when t already is the form asked for)
        owner.__dict__.setdefault(_ATTR, {})[key] = (t._version, t.data_ptr(), value)
    return value

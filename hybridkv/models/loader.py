"""Reading a Hugging Face checkpoint folder: config.json, safetensors (single or sharded),
tokenizer.json and generation_config.json."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order; a clear error if none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {index}: {exc}") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder} is missing weight shards {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(f"{folder} holds no model weights (model.safetensors or a sharded index)")


def iter_weights(folder: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every checkpoint tensor. `lazy`: (name, safetensors slice) instead,
    read by the consumer before the next item (a tensor-parallel rank reads only its rows:
    `hybridkv.distributed.parallel.read_shard`)."""
    from safetensors import safe_open

    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def eos_token_ids(config: dict[str, Any], gen_config: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json first, then config.json."""
    for source in (gen_config, config):
        value = source.get("eos_token_id")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        return tuple(int(v) for v in values)
    return ()


def stack_gated_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
    pattern: re.Pattern[str],
    num_experts: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors of a gated MoE -> `{prefix}.gate_up_proj` [E, 2I, H] and
    `{prefix}.down_proj` [E, H, I], each yielded once every expert of its layer arrived; every
    other tensor passes through. `pattern` matches one expert's tensor as (prefix, expert index,
    projection), `names` are the checkpoint's (gate, up, down) projection names."""
    gate, up, down = names
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in weights:
        match = pattern.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, proj = match.groups()
        if int(expert) >= num_experts:
            raise ValueError(f"{name}: expert {expert} but num_experts is {num_experts}")
        parts = pending.setdefault(prefix, {})
        parts[(int(expert), proj)] = tensor  # [out, in]
        if len(parts) == 3 * num_experts:
            del pending[prefix]
            experts = range(num_experts)
            gate_up = [torch.cat([parts[(e, gate)], parts[(e, up)]]) for e in experts]
            yield f"{prefix}.gate_up_proj", torch.stack(gate_up)  # [E, 2I, H]
            yield f"{prefix}.down_proj", torch.stack([parts[(e, down)] for e in experts])
    if pending:
        got = {prefix: len(parts) for prefix, parts in pending.items()}
        raise ValueError(f"checkpoint lacks some experts' tensors: {got}")

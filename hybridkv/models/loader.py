"""Reading a Hugging Face checkpoint folder: config.json, safetensors (single or sharded),
tokenizer.json and generation_config.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
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


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


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

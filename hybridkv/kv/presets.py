"""Bundled model configs (real hyper-parameters of popular models, no weights).

Each preset file is `<org>__<name>.json` and is addressed by its Hugging Face id `<org>/<name>`.
The file keeps its provenance (`source`, `confidence`, `notes`); `config` holds keys spelled as in
the model's config.json, `derived` and `effective_defaults` fill keys the copy lacked.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.kv.specs import ConfigError


def _preset_dir():
    return resources.files("hybridkv.kv").joinpath("presets")


@cache
def preset_ids() -> tuple[str, ...]:
    names = [p.name for p in _preset_dir().iterdir() if p.name.endswith(".json")]
    return tuple(sorted(n[: -len(".json")].replace("__", "/", 1) for n in names))


def _merge_fillers(config: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Add `derived` / `effective_defaults` values for keys the config lacks.

    Only values of real config types are taken; prose such as a rule written as a sentence is
    skipped. Nested configs (`text_config`) receive them, as that is where the model reads them.
    """
    target = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    for section in ("derived", "effective_defaults"):
        for key, value in (record.get(section) or {}).items():
            if key.startswith("_") or key in target or isinstance(value, str):
                continue
            target[key] = value
    return config


@cache
def _load_preset(model_id: str) -> str:
    path = _preset_dir().joinpath(model_id.replace("/", "__", 1) + ".json")
    record = json.loads(path.read_text())
    return json.dumps(_merge_fillers(dict(record["config"]), record))


def load_preset(model_id: str) -> dict[str, Any]:
    if model_id not in preset_ids():
        raise ConfigError(
            f"unknown preset {model_id!r}; bundled presets: {', '.join(preset_ids())}"
        )
    return json.loads(_load_preset(model_id))


def load_model_config(model: str | Path) -> dict[str, Any]:
    """A config dict from a folder holding config.json, a config.json path or a preset id."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model folder {model!s} has no config.json")
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path} as JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
        return data
    if str(model) in preset_ids():
        return load_preset(str(model))
    raise ConfigError(
        f"model {str(model)!r} is neither a folder with config.json, a config.json "
        f"path, nor a bundled preset ({', '.join(preset_ids())})"
    )

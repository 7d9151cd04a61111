"""Checkpoint reading: single and sharded safetensors, generation_config eos, bad folders."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from hybridkv.engine import Engine
from hybridkv.models.loader import checkpoint_files, eos_token_ids, iter_weights
from hybridkv.sampling_params import SamplingParams


def test_sharded_checkpoint_loads_like_the_single_file(tiny_model_dir, tmp_path):
    weights = dict(iter_weights(tiny_model_dir))
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for extra in ("config.json", "tokenizer.json", "generation_config.json"):
        (tmp_path / extra).write_text((tiny_model_dir / extra).read_text())
    assert [p.name for p in checkpoint_files(tmp_path)] == sorted(shards)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    single = Engine(str(tiny_model_dir), dtype="float32")
    sharded = Engine(str(tmp_path), dtype="float32")
    ids = [[1, 2, 3, 4], [9, 8]]
    for eng in (single, sharded):
        for p in ids:
            eng.add_request(p, params)
    outs = []
    for eng in (single, sharded):
        done = []
        while eng.has_unfinished:
            done += [o.token_ids for o in eng.step() if o.finished]
        outs.append(sorted(done))
    assert outs[0] == outs[1]


def test_missing_shard_and_bad_index(tiny_model_dir, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="missing weight shards model-00001-of-00002"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ValueError, match="cannot read"):
        checkpoint_files(tmp_path)


def test_eos_ids_from_generation_config_first():
    assert eos_token_ids({"eos_token_id": 2}, {"eos_token_id": [7, 8]}) == (7, 8)
    assert eos_token_ids({"eos_token_id": 2}, {}) == (2,)
    assert eos_token_ids({}, {}) == ()


def test_a_missing_weight_is_named(tiny_model_dir, tmp_path):
    weights = dict(iter_weights(tiny_model_dir))
    dropped = sorted(weights)[3]
    del weights[dropped]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    for extra in ("config.json", "tokenizer.json"):
        (tmp_path / extra).write_text((tiny_model_dir / extra).read_text())
    with pytest.raises(ValueError, match="checkpoint is missing 1 weights"):
        Engine(str(tmp_path), dtype="float32")

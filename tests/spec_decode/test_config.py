"""SpeculativeConfig: vLLM's spelling parsed, every vLLM key honoured or refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridkv.spec_decode.config import (
    DEFAULT_ONLY,
    HONOURED_KEYS,
    MAX_SPECULATIVE_TOKENS,
    MTP_ALIASES,
    UNSUPPORTED_METHODS,
    SpeculativeConfig,
)


def parse(**kw: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict(kw)


def refused(match: str, **kw: object) -> str:
    """The one-line error of parsing `kw`, which must match `match`."""
    with pytest.raises(ValueError, match=match) as info:
        SpeculativeConfig.from_dict(kw)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- ngram ------------------------------------------------------------------------------------


def test_ngram_full():
    c = parse(method="ngram", num_speculative_tokens=4, prompt_lookup_max=6, prompt_lookup_min=2)
    assert (c.method, c.num_speculative_tokens) == ("ngram", 4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 6)
    assert c.model is None and c.disable_by_batch_size is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2))],
)
def test_ngram_lookup_defaults_as_vllm(given, expected):
    """Neither bound: 5 and 5; one bound: the other takes its value."""
    c = parse(method="ngram", num_speculative_tokens=3, **given)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == expected


@pytest.mark.parametrize("alias", ["[ngram]", "ngram_gpu"])
def test_ngram_method_aliases(alias):
    assert parse(method=alias, num_speculative_tokens=2).method == "ngram"


@pytest.mark.parametrize("model", ["ngram", "[ngram]"])
def test_model_ngram_names_the_method(model):
    """vLLM infers method ngram from model "ngram" / "[ngram]"; the model is then no model."""
    c = parse(model=model, num_speculative_tokens=2)
    assert c.method == "ngram" and c.model is None


def test_ngram_needs_k():
    refused("ngram' needs num_speculative_tokens", method="ngram")


@pytest.mark.parametrize("k", [0, -1, MAX_SPECULATIVE_TOKENS + 1, 2.5, "4", True])
def test_k_validated(k):
    refused("num_speculative_tokens must be", method="ngram", num_speculative_tokens=k)


def test_k_bounds_accepted():
    for k in (1, MAX_SPECULATIVE_TOKENS):
        assert parse(method="ngram", num_speculative_tokens=k).num_speculative_tokens == k


def test_lookup_min_above_max_refused():
    msg = refused(
        "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        method="ngram",
        num_speculative_tokens=2,
        prompt_lookup_max=2,
        prompt_lookup_min=4,
    )
    assert msg.startswith("speculative_config: ")


@pytest.mark.parametrize("key", ["prompt_lookup_max", "prompt_lookup_min"])
@pytest.mark.parametrize("value", [0, 65, "3", None.__class__])
def test_lookup_values_validated(key, value):
    kw = {key: value}
    with pytest.raises(ValueError, match=key):
        parse(method="ngram", num_speculative_tokens=2, **kw)


def test_ngram_refuses_a_model():
    refused("takes no model", method="ngram", num_speculative_tokens=2, model="some/draft")


def test_ngram_refuses_probabilistic_drafts():
    refused(
        "needs method 'mtp'",
        method="ngram",
        num_speculative_tokens=2,
        draft_sample_method="probabilistic",
    )


# -- mtp ----------------------------------------------------------------------------------------


def test_mtp_k_from_the_checkpoint():
    c = parse(method="mtp")
    assert c.num_speculative_tokens is None
    assert c.prompt_lookup_max is None and c.prompt_lookup_min is None
    r = c.for_target("/models/qwen3-next", mtp_layers=1)
    assert r.num_speculative_tokens == 1
    assert parse(method="mtp").for_target("m", mtp_layers=3).num_speculative_tokens == 3


@pytest.mark.parametrize("alias", sorted(MTP_ALIASES))
def test_mtp_aliases(alias):
    assert parse(method=alias, num_speculative_tokens=1).method == "mtp"


def test_mtp_model_must_be_the_target():
    c = parse(method="mtp", num_speculative_tokens=2, model="/models/a")
    assert c.for_target("/models/a", mtp_layers=1).model is None
    with pytest.raises(ValueError, match="model must be None or '/models/b'"):
        c.for_target("/models/b", mtp_layers=1)


def test_mtp_needs_mtp_layers():
    with pytest.raises(ValueError, match="has none"):
        parse(method="mtp", num_speculative_tokens=1).for_target("m", mtp_layers=0)


def test_mtp_k_multiple_of_layers():
    """vLLM: a k larger than the MTP layer count must be a multiple of it."""
    c = parse(method="mtp", num_speculative_tokens=3)
    assert c.for_target("m", mtp_layers=1).num_speculative_tokens == 3
    assert c.for_target("m", mtp_layers=3).num_speculative_tokens == 3
    assert c.for_target("m", mtp_layers=4).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="multiple"):
        c.for_target("m", mtp_layers=2)


def test_mtp_draft_tensor_parallel_size():
    c = parse(method="mtp", num_speculative_tokens=1, draft_tensor_parallel_size=2)
    assert c.for_target("m", tensor_parallel_size=2, mtp_layers=1).draft_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 must equal"):
        c.for_target("m", tensor_parallel_size=4, mtp_layers=1)
    # ngram has no draft model: any size is accepted
    n = parse(method="ngram", num_speculative_tokens=1, draft_tensor_parallel_size=1)
    assert n.for_target("m", tensor_parallel_size=4) == n


def test_mtp_refuses_lookup_bounds():
    refused("ngram option", method="mtp", num_speculative_tokens=1, prompt_lookup_max=3)


def test_mtp_probabilistic_drafts():
    c = parse(method="mtp", num_speculative_tokens=1, draft_sample_method="probabilistic")
    assert c.draft_sample_method == "probabilistic"
    refused("draft_sample_method must be", method="mtp", draft_sample_method="top_k")


# -- methods and keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(UNSUPPORTED_METHODS))
def test_unsupported_vllm_methods_refused(method):
    msg = refused("not supported", method=method, num_speculative_tokens=2)
    assert repr(method) in msg and "'ngram', 'mtp'" in msg


def test_unknown_method_and_missing_method():
    refused("unknown method 'ngrams'", method="ngrams", num_speculative_tokens=2)
    refused("needs a method", num_speculative_tokens=2)
    refused("draft model", model="org/small-draft", num_speculative_tokens=2)
    refused("method must be", method=3)


def test_unknown_key_names_valid_keys_and_suggests():
    msg = refused("unknown key 'prompt_lookup_maxx'", method="ngram", prompt_lookup_maxx=3)
    assert "did you mean 'prompt_lookup_max'" in msg
    for key in HONOURED_KEYS:
        assert key in msg
    msg = refused("unknown key 'zzz'", method="ngram", zzz=1)
    assert "did you mean" not in msg


def _default(allowed: tuple[object, ...]) -> object:
    return allowed[0]


@pytest.mark.parametrize("key", sorted(DEFAULT_ONLY))
def test_every_default_only_key_accepted_at_default_refused_otherwise(key):
    allowed, why = DEFAULT_ONLY[key]
    c = parse(method="ngram", num_speculative_tokens=2, **{key: _default(allowed)})
    assert c.method == "ngram"
    bad = "something-else" if not isinstance(_default(allowed), str) else 12345
    msg = refused(f"{key}=", method="ngram", num_speculative_tokens=2, **{key: bad})
    assert why in msg and "allowed:" in msg


def test_default_only_keys_keep_true_apart_from_one():
    refused("disable_mqa_scorer=1", method="ngram", num_speculative_tokens=2, disable_mqa_scorer=1)
    # but a float default written without its point is the default
    c = parse(method="ngram", num_speculative_tokens=2, suffix_decoding_max_spec_factor=1)
    assert c.num_speculative_tokens == 2


def test_vllm_style_config_with_defaults_spelled_out():
    """A config copied from vLLM with its defaults written out parses."""
    text = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
            "enforce_eager": None,
            "quantization": None,
            "rejection_sample_method": "standard",
            "disable_padded_drafter_batch": False,
            "suffix_decoding_max_tree_depth": 24,
            "suffix_decoding_min_token_prob": 0.1,
            "draft_sample_method": "greedy",
        }
    )
    c = SpeculativeConfig.from_cli(text)
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 4, 2)


def test_tensor_parallel_size_points_to_draft_key():
    refused("draft_tensor_parallel_size", method="mtp", tensor_parallel_size=2)


def test_disable_by_batch_size_and_max_model_len():
    refused("disable_by_batch_size must be >= 2", method="mtp", disable_by_batch_size=1)
    refused("max_model_len must be >= 1", method="mtp", max_model_len=0)
    c = parse(method="ngram", num_speculative_tokens=4, disable_by_batch_size=8, max_model_len=100)
    assert c.max_drafts(num_running=7, num_tokens=10) == 4
    assert c.max_drafts(num_running=8, num_tokens=10) == 0  # vLLM: running >= threshold
    assert c.max_drafts(num_running=1, num_tokens=95) == 4  # 95 + 4 < 100
    assert c.max_drafts(num_running=1, num_tokens=96) == 0  # 96 + 4 reaches 100
    with pytest.raises(ValueError, match="cannot exceed"):
        c.for_target("m", max_model_len=50)
    assert c.for_target("m", max_model_len=100) == c


def test_max_drafts_needs_resolved_k():
    with pytest.raises(ValueError, match="for_target"):
        parse(method="mtp").max_drafts(1, 1)
    assert parse(method="mtp").for_target("m", mtp_layers=2).max_drafts(1, 1) == 2


# -- JSON and round trips -------------------------------------------------------------------------


def test_from_cli_bad_json_is_one_clear_line():
    with pytest.raises(ValueError, match="--speculative-config is not valid JSON") as info:
        SpeculativeConfig.from_cli("{method: ngram}")
    assert "\n" not in str(info.value) and '"method": "ngram"' in str(info.value)
    with pytest.raises(ValueError, match="must be a JSON object"):
        SpeculativeConfig.from_cli("[1, 2]")


def test_parse_accepts_every_form():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert c is not None
    assert SpeculativeConfig.parse(c) is c
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}') == c
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        SpeculativeConfig.parse("ngram")
    with pytest.raises(ValueError, match="must be a dict"):
        SpeculativeConfig.parse(4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 4},
        {"method": "mtp", "draft_sample_method": "probabilistic", "max_model_len": 4096},
    ],
)
def test_to_dict_round_trip(config):
    c = SpeculativeConfig.from_dict(config)
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    assert SpeculativeConfig.from_cli(json.dumps(c.to_dict())) == c


def test_frozen_and_checked_on_construction():
    c = parse(method="ngram", num_speculative_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="method must be"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="needs prompt_lookup_max"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2)


# -- num_speculative_tokens_per_batch_size (vLLM's dynamic k) and adaptive_k ---------------------


def test_batch_size_schedule_as_vllm_looks_it_up():
    """The range holding the batch size gives k; a gap or a batch past the last range takes
    the k of the range before (vLLM's dense lookup)."""
    c = parse(
        method="ngram", num_speculative_tokens=5,
        num_speculative_tokens_per_batch_size=[[5, 8, 2], [1, 1, 5], [2, 3, 3], [12, 16, 0]],
    )  # fmt: skip
    assert c.num_speculative_tokens_per_batch_size == ((1, 1, 5), (2, 3, 3), (5, 8, 2),
                                                       (12, 16, 0))  # fmt: skip
    got = [c.k_for_batch_size(b) for b in range(1, 20)]
    assert got == [5, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0]
    assert [c.max_drafts(b, 10) for b in (1, 2, 6, 12)] == [5, 3, 2, 0]
    assert c.max_drafting_batch(64) == 11 and c.max_drafting_batch(4) == 4
    # with disable_by_batch_size both apply
    d = dataclasses.replace(c, disable_by_batch_size=3)
    assert [d.max_drafts(b, 10) for b in (1, 2, 3)] == [5, 3, 0]
    assert d.max_drafting_batch(64) == 2
    assert parse(method="ngram", num_speculative_tokens=2).max_drafting_batch(7) == 7


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ([], "non-empty list"),
        ("[[1, 4, 2]]", "non-empty list"),
        ([[1, 4]], r"each entry must be \[lo, hi, k\]"),
        ([[1, 4, 2, 5, 3]], "context-length bounds"),
        ([[1, 4, 2.0]], "must hold integers"),
        ([[1, True, 2]], "must hold integers"),
        ([[0, 4, 2]], "1 <= lo <= hi"),
        ([[1, 4, 2], [6, 5, 1]], "1 <= lo <= hi"),
        ([[1, 4, 2], [4, 8, 1]], "overlaps the range before it"),
        ([[2, 4, 2]], "must start at batch size 1, got 2"),
        ([[1, 4, -1]], r"k must be in 0\.\.num_speculative_tokens=3"),
        ([[1, 4, 4]], r"k must be in 0\.\.num_speculative_tokens=3"),
    ],
)
def test_batch_size_schedule_refusals(schedule, match):
    msg = refused(match, method="ngram", num_speculative_tokens=3,
                  num_speculative_tokens_per_batch_size=schedule)  # fmt: skip
    assert "num_speculative_tokens_per_batch_size" in msg


def test_batch_size_schedule_for_mtp_checked_once_k_is_known():
    c = parse(method="mtp", num_speculative_tokens_per_batch_size=[[1, 2, 1], [3, 8, 0]])
    assert c.for_target("m", mtp_layers=1).k_for_batch_size(4) == 0
    with pytest.raises(ValueError, match="k must be in 0..num_speculative_tokens=1"):
        parse(method="mtp", num_speculative_tokens_per_batch_size=[[1, 2, 2]]).for_target(
            "m", mtp_layers=1
        )


def test_adaptive_k_is_a_bool_and_hybridkvs_own_key():
    assert parse(method="ngram", num_speculative_tokens=2).adaptive_k is False
    c = parse(method="ngram", num_speculative_tokens=2, adaptive_k=True)
    assert c.adaptive_k is True and c.to_dict()["adaptive_k"] is True
    refused("adaptive_k must be true or false, got 1", method="ngram",
            num_speculative_tokens=2, adaptive_k=1)  # fmt: skip
    # at its default it is left out of the vLLM spelling
    assert "adaptive_k" not in parse(method="ngram", num_speculative_tokens=2).to_dict()


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "num_speculative_tokens": 4,
         "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 64, 1]]},
        {"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": True},
    ],
)  # fmt: skip
def test_schedule_and_adaptive_round_trip(config):
    c = SpeculativeConfig.from_dict(config)
    assert SpeculativeConfig.from_cli(json.dumps(c.to_dict())) == c

"""Engine-level sampling features: prompt log-probs (against transformers and against the
log-probs of generation), logits processing, and requests held behind another (n > 1)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import DEFAULT_MODEL, Engine
from hybridkv.sampling_params import SamplingParams
from tests.models.utils import prompts, reference_logits


def run(engine: Engine, prompt, params: SamplingParams, **kw):
    req = engine.add_request(prompt, params, **kw)
    last = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == req.request_id:
                last = out
    assert last is not None and last.finished
    return last


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(str(DEFAULT_MODEL), dtype="float32", max_model_len=512)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_equal_transformers(tiny_model_dir, chunk):
    """Every prompt position's log-prob and top-3 match transformers' log_softmax of the same
    weights, in one prefill and in chunks of 7 tokens (positions split across steps)."""
    from transformers import AutoModelForCausalLM

    kw = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 2}
    eng = Engine(str(tiny_model_dir), dtype="float32", **kw)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    (ids,) = prompts(96, [23], seed=3)
    out = run(eng, ids, SamplingParams(max_tokens=1, prompt_logprobs=3))
    with torch.inference_mode():
        ref = torch.log_softmax(reference_logits(hf, ids), dim=-1)
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry = entries[pos]
        assert entry[ids[pos]] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        top = ref[pos - 1].topk(3)
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[token] == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_equal_generation_logprobs_and_skip_the_cache(engine):
    """Teacher forcing: the log-probs of a greedy continuation, scored as a prompt, equal the
    log-probs it was generated with. A request with prompt log-probs computes its whole prompt
    even when the prefix cache holds it (it still leaves it cached for others)."""
    prompt = "def fibonacci(n):\n    return n\n" * 20  # past one prefix-cache block
    gen = run(engine, prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=0))
    ids = gen.prompt_token_ids + gen.token_ids
    scored = run(engine, ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert scored.num_cached_tokens == 0
    n = len(gen.prompt_token_ids)
    for k, token in enumerate(gen.token_ids):
        want = gen.logprobs[k][token]
        assert scored.prompt_logprobs[n + k][token] == pytest.approx(want, abs=1e-4)
    again = run(engine, ids, SamplingParams(max_tokens=1))
    assert again.num_cached_tokens > 0


def test_logit_bias_forces_and_bans_tokens(engine):
    prompt = "import os\n"
    plain = run(engine, prompt, SamplingParams(max_tokens=4, temperature=0))
    banned = plain.token_ids[0]
    out = run(engine, prompt, SamplingParams(max_tokens=4, temperature=0,
                                             logit_bias={banned: -100}))  # fmt: skip
    assert banned not in out.token_ids
    forced = run(engine, prompt, SamplingParams(max_tokens=3, temperature=0.9, seed=1,
                                                logit_bias={77: 100}))  # fmt: skip
    assert forced.token_ids == [77, 77, 77]
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        engine.add_request(prompt, SamplingParams(logit_bias={10**6: 1.0}))


def test_penalties_stop_repetition(engine):
    """The tiny model repeats itself greedily; a strong frequency or repetition penalty makes
    every token of a short greedy output distinct from those before it."""
    prompt = "    def __init__(self):\n        self."
    plain = run(engine, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert len(set(plain.token_ids)) < len(plain.token_ids)  # repeats
    for kw in ({"presence_penalty": 2.0}, {"repetition_penalty": 100.0}):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)
        out = run(engine, prompt, params)
        assert len(set(out.token_ids)) == len(out.token_ids), kw


def test_min_p_one_is_greedy(engine):
    prompt = "class Foo:\n"
    greedy = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=5, ignore_eos=True)
    assert run(engine, prompt, params).token_ids == greedy.token_ids


def test_held_request_shares_the_first_ones_prefill(engine):
    """A request added `after` another waits until that prompt is computed, then takes it from
    the prefix cache: the second choice of an n = 2 request does not prefill again."""
    prompt = "import sys\n" * 80
    params = SamplingParams(max_tokens=5, temperature=0)
    first = engine.add_request(prompt, params)
    second = engine.add_request(prompt, params, after=first.request_id)
    assert second not in engine.scheduler.waiting
    outs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outs[out.request_id] = out
    a, b = outs[first.request_id], outs[second.request_id]
    assert a.token_ids == b.token_ids
    block = engine.cache.hit_tokens
    assert b.num_cached_tokens == (len(a.prompt_token_ids) - 1) // block * block > 0
    # aborting a held request before it starts leaves nothing behind
    third = engine.add_request(prompt + "x", params)
    fourth = engine.add_request(prompt + "x", params, after=third.request_id)
    engine.abort(fourth.request_id)
    while engine.has_unfinished:
        engine.step()
    assert fourth.request_id not in engine.requests and not engine._held

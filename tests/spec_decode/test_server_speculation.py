"""Speculative decoding behind the OpenAI server, through the real `openai` SDK: the same
greedy text as without drafts, streamed or not, next to requests that cannot carry drafts
(log-probs, penalties, structured outputs), and the drafts counted on /metrics."""

from __future__ import annotations

import openai
import pytest

from hybridkv.engine import DEFAULT_MODEL, Engine
from tests.entrypoints.server_utils import metric_values, running_server, wait_idle

MODEL = "spec-model"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"


@pytest.fixture(scope="module")
def servers():
    plain = Engine(str(DEFAULT_MODEL), dtype="float32", max_model_len=512)
    spec = Engine(str(DEFAULT_MODEL), dtype="float32", max_model_len=512, speculative_config=SPEC)
    with running_server(plain, MODEL) as a, running_server(spec, MODEL) as b:
        yield a, b


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_same_greedy_text_with_and_without_drafts(servers) -> None:
    plain, spec = servers
    texts = []
    for server in servers:
        client = _client(server)
        done = client.completions.create(model=MODEL, prompt=CODE, max_tokens=48, temperature=0)
        stream = client.completions.create(
            model=MODEL, prompt=CODE, max_tokens=48, temperature=0, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CODE}], max_tokens=32,
            temperature=0,
        )  # fmt: skip
        logprobs = client.completions.create(
            model=MODEL, prompt=CODE, max_tokens=16, temperature=0, logprobs=2
        )
        penalised = client.completions.create(
            model=MODEL, prompt=CODE, max_tokens=16, temperature=0, frequency_penalty=0.5
        )
        assert streamed == done.choices[0].text
        assert done.usage.completion_tokens == 48
        texts.append(
            (done.choices[0].text, chat.choices[0].message.content, logprobs.choices[0].text,
             penalised.choices[0].text)  # fmt: skip
        )
    assert texts[0] == texts[1]
    wait_idle(spec)
    values = metric_values(spec.base_url)
    assert values["hybridkv_spec_decode_num_draft_tokens_total"] > 0
    assert values["hybridkv_spec_decode_num_accepted_tokens_total"] > 0
    assert 0 < values["hybridkv_spec_decode_acceptance_rate"] <= 1
    assert "hybridkv_spec_decode_num_drafts_total" not in metric_values(plain.base_url)
    assert spec.engine.cache.usage()["in_use"] == 0

"""Structured outputs through a real server: random JSON schemas (tests/structured/schema_gen.py)
sent all at once as chat `response_format` json_schema, half streamed, sampled at temperature
0.7..1 with seeds by the default model (which knows no JSON: only the grammar makes the output
valid). Every output must parse, validate against its schema and finish with "stop".

Sent concurrently so one engine step holds many grammar rows: the sampler fills and applies
their bitmasks as one batch, next to each other's rows. Also: a stop string inside structured
output, a max_tokens cut, and a schema request whose long prompt comes from the prefix cache."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import jsonschema
import pytest

from hybridkv.engine import DEFAULT_MODEL, Engine
from tests.entrypoints.server_utils import running_server, wait_idle
from tests.structured.schema_gen import random_schema

MODEL = "schema-model"
N_SCHEMAS = 50
MAX_TOKENS = 700
LONG = "class Cache:\n    def get(self, key):\n        return self.data[key]\n" * 10


@pytest.fixture(scope="module")
def server():
    engine = Engine(str(DEFAULT_MODEL), dtype="float32", max_num_seqs=64, max_model_len=1024)
    with running_server(engine, MODEL) as srv:
        yield srv


def chat_body(schema: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Reply in JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema, "strict": True},
        },
        **fields,
    }


async def send(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str, dict]:
    """(content, finish_reason, usage) of one chat request; a stream's deltas joined."""
    if not body.get("stream"):
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], out["usage"]
    parts, finish, usage = [], None, {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(parts), finish, usage


def run_all(server, bodies: list[dict[str, Any]]) -> list[tuple[str, str, dict]]:
    async def main():
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*(send(client, b) for b in bodies))

    return asyncio.run(main())


def test_random_schemas_all_at_once(server, monkeypatch):
    rng = random.Random(2024)
    schemas = [random_schema(seed) for seed in range(N_SCHEMAS)]
    bodies = [
        chat_body(
            schema,
            stream=k % 2 == 1,
            stream_options={"include_usage": True} if k % 2 else None,
            temperature=round(rng.uniform(0.7, 1.0), 3),
            seed=1000 + k,
            max_tokens=MAX_TOKENS,
        )
        for k, schema in enumerate(schemas)
    ]
    sampler = server.engine.sampler
    widths: list[int] = []  # grammar rows per sampler call
    mask = sampler._mask_grammar

    def spy(x, rows, grammar, bitmask):
        widths.append(len(grammar))
        assert bitmask is not None  # filled by the engine's mask thread during the forward
        return mask(x, rows, grammar, bitmask)

    monkeypatch.setattr(sampler, "_mask_grammar", spy)
    results = run_all(server, bodies)
    for k, (schema, (text, finish, usage)) in enumerate(zip(schemas, results, strict=True)):
        where = f"schema {k} ({'streamed' if k % 2 else 'whole'}): {text!r}"
        assert finish == "stop", where
        assert 0 < usage["completion_tokens"] < MAX_TOKENS, where
        jsonschema.validate(json.loads(text), schema)
    # the requests overlapped: at least half of them were masked in one sampler call
    assert max(widths) >= N_SCHEMAS // 2, max(widths)
    wait_idle(server)


def test_stop_string_inside_structured_output(server):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    body = chat_body(schema, stream=True, stop=[":"], temperature=0.9, seed=5, max_tokens=100)
    # compact JSON in the schema's property order: the first ":" follows the first key
    ((text, finish, _),) = run_all(server, [body])
    assert (text, finish) == ('{"name"', "stop")
    wait_idle(server)


def test_max_tokens_cut_says_length(server):
    bodies = [
        chat_body(random_schema(7), stream=stream, temperature=1.0, seed=3, max_tokens=4)
        for stream in (False, True)
    ]
    for text, finish, usage in run_all(server, bodies):
        assert finish == "length"
        assert text.startswith("{")
        if usage:
            assert usage["completion_tokens"] == 4
    wait_idle(server)


def test_prefix_cache_hit_with_a_schema(server):
    schema = random_schema(11)
    body = chat_body(schema, temperature=0.8, seed=9, max_tokens=MAX_TOKENS)
    body["messages"] = [{"role": "user", "content": LONG}]
    first, second = (run_all(server, [body])[0] for _ in range(2))
    assert second[2]["prompt_tokens"] == first[2]["prompt_tokens"]
    assert second[2]["prompt_tokens_details"]["cached_tokens"] > 0
    for text, finish, _ in (first, second):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)
    assert second[0] == first[0]  # same seed, same output, cached prefix or not
    wait_idle(server)

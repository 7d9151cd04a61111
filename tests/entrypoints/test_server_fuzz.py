"""Fuzz: random JSON values at every field of both endpoints while streams run. No 5xx, every
error in OpenAI's shape, every stream ends with [DONE], and afterwards the engine is idle with
its pool intact."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridkv.engine import Engine
from tests.entrypoints.server_utils import (
    ERROR_KEYS,
    random_body,
    running_server,
    sse_events,
    wait_idle,
)

MODEL = "tiny"
REQUESTS = 300


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), dtype="float32", max_num_seqs=16, max_model_len=256)
    with running_server(engine, MODEL) as srv:
        yield srv


def check_response(r: httpx.Response, stream: bool) -> str:
    """The outcome of one fuzzed request: "ok", "error_<status>"; fails on anything else."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()
        assert set(err) == {"error"} and set(err["error"]) == ERROR_KEYS, err
        return f"error_{r.status_code}"
    if stream:
        events = sse_events(r)
        assert events and events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            assert "error" not in e, e
            for c in e["choices"]:
                assert c["finish_reason"] in (None, "stop", "length", "tool_calls"), c
    else:
        for c in r.json()["choices"]:
            assert c["finish_reason"] in ("stop", "length", "tool_calls"), c
    return "ok"


def send(base_url: str, body) -> str:
    chat = isinstance(body, tuple)
    body = body[1] if chat else body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = isinstance(body, dict) and body.get("stream") is True
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as c:
        if stream:
            with c.stream("POST", base_url + path, content=content, headers=headers) as r:
                r.read()
                return check_response(r, stream=True)
        return check_response(c.post(base_url + path, content=content, headers=headers), False)


def test_fuzz_every_field_while_streams_run(server):
    rng = random.Random(1234)
    bodies = []
    for _ in range(REQUESTS):
        chat = rng.random() < 0.5
        body = random_body(rng, chat, MODEL)
        bodies.append((True, body) if chat else body)

    streams: list = []

    def stream_one(k: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"t{k} t{k + 1}",
            "max_tokens": 120,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
            streams.append((r.status_code, sse_events(r)))

    background = [threading.Thread(target=stream_one, args=(k,)) for k in range(3)]
    for t in background:
        t.start()
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda b: send(server.base_url, b), bodies))
    for t in background:
        t.join(timeout=120)

    counts = {o: outcomes.count(o) for o in set(outcomes)}
    print(f"fuzz outcomes: {counts}")
    assert counts.get("ok", 0) >= 10 and counts.get("error_400", 0) >= 100
    assert len(streams) == 3
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(server)
    stats = server.async_engine.stats
    assert not stats["running"] and not stats["waiting"] and stats["usage"]["in_use"] == 0
    server.engine.cache.check_integrity()  # the engine is idle: safe from this thread

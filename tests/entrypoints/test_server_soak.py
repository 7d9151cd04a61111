"""Soak: mixed clients against a server for --soak-seconds (default 30; half of it plain, half
with speculative decoding): streaming and not,
completions and chat, several prompts per request, log-probs, clients that leave mid-stream or
before a non-streaming answer, bad input, shared prompt prefixes, and a pool small enough that
requests are preempted. Afterwards nothing runs or waits, the pool is idle and intact, no
submission is left behind, and the process's memory did not keep growing."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time

import httpx
import pytest

from hybridkv.engine import Engine
from tests.entrypoints.server_utils import (
    ERROR_KEYS,
    metric_values,
    random_body,
    running_server,
    wait_idle,
)
from tests.memory import rss_bytes

MODEL = "tiny"
CLIENTS = 12
WARM_UP_S = 45.0  # at most a quarter of the run
# Generous: after the warm-up the C allocator's arenas still grow (about +100 MiB over the next
# minute here, +35 MiB over the four after that); Python objects must not (a few thousand).
RSS_GROWTH_BOUND = 256 * 2**20
OBJECT_GROWTH_BOUND = 20_000


def python_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.fixture(scope="module", params=["plain", "speculative"])
def server(tiny_model_dir, request):
    # 24 pages of 32 tokens for 8 concurrent requests of up to ~200 tokens: preemption happens;
    # once plain, once with speculative decoding (n-gram drafts, often rejected: state
    # rollbacks under preemption, aborts and bad input)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = Engine(
        str(tiny_model_dir), dtype="float32", max_num_seqs=8, max_model_len=256, num_pages=24,
        speculative_config=spec if request.param == "speculative" else None,
    )  # fmt: skip
    with running_server(engine, MODEL) as srv:
        yield srv


PREFIXES = ["t1 t2 t3 t4 t5 t6 t7 t8 " * 4, "t9 t10 t11 t12 " * 6, ""]


def _prompt(rng: random.Random) -> str:
    words = " ".join(f"t{rng.randrange(2, 90)}" for _ in range(rng.randint(1, 30)))
    return rng.choice(PREFIXES) + words


def _params(rng: random.Random) -> dict:
    params = {"max_tokens": rng.randint(1, 100), "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.5:
        params["temperature"] = 0
    else:
        params |= {"temperature": 0.8, "seed": rng.randrange(2**32), "top_p": 0.9}
    if rng.random() < 0.2:
        params["stop"] = [f"t{rng.randrange(2, 90)}"]
    return params


class Tally:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []

    def add(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def fail(self, what: str) -> None:
        self.failures.append(what[:500])


def _check_events(lines: list[str], tally: Tally, what: str) -> None:
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        tally.fail(f"{what}: stream did not end with [DONE]: {data[-2:]}")
        return
    for d in data[:-1]:
        event = json.loads(d)
        if "error" in event:
            tally.fail(f"{what}: error event {event}")
        for c in event.get("choices", []):
            if c.get("finish_reason") not in (None, "stop", "length"):
                tally.fail(f"{what}: finish_reason {c.get('finish_reason')}")


def _check_json(r: httpx.Response, tally: Tally, what: str) -> None:
    if r.status_code != 200:
        tally.fail(f"{what}: {r.status_code} {r.text[:200]}")
        return
    for c in r.json()["choices"]:
        if c["finish_reason"] not in ("stop", "length"):
            tally.fail(f"{what}: finish_reason {c['finish_reason']}")


async def _client(base: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    C, CHAT = base + "/v1/completions", base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            action = rng.choices(
                ["stream", "complete", "multi", "chat", "chat_stream", "leave_stream",
                 "leave_waiting", "bad", "logprobs"],
                weights=[4, 3, 2, 2, 2, 2, 2, 3, 1],
            )[0]  # fmt: skip
            tally.add(action)
            body = {"model": MODEL, "prompt": _prompt(rng), **_params(rng)}
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": _prompt(rng)}],
                **_params(rng),
            }
            if action in ("stream", "chat_stream", "logprobs"):
                url, b = (CHAT, chat) if action == "chat_stream" else (C, body)
                b = {**b, "stream": True, "stream_options": {"include_usage": True}}
                if action == "logprobs":
                    b["logprobs"] = 2
                async with http.stream("POST", url, json=b) as r:
                    if r.status_code != 200:
                        tally.fail(f"{action}: {r.status_code} {(await r.aread())[:200]!r}")
                        continue
                    lines = [ln async for ln in r.aiter_lines()]
                _check_events(lines, tally, action)
            elif action == "complete":
                _check_json(await http.post(C, json=body), tally, action)
            elif action == "multi":
                prompts = [_prompt(rng) for _ in range(rng.randint(2, 4))]
                _check_json(await http.post(C, json={**body, "prompt": prompts}), tally, action)
            elif action == "chat":
                _check_json(await http.post(CHAT, json=chat), tally, action)
            elif action == "leave_stream":  # read a few events, then hang up
                b = {**body, "stream": True, "max_tokens": 100, "ignore_eos": True}
                async with http.stream("POST", C, json=b) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= rng.randint(1, 5):
                            break
            elif action == "leave_waiting":  # a non-streaming client that gives up
                b = {**body, "max_tokens": 100, "ignore_eos": True}
                try:
                    r = await http.post(C, json=b, timeout=rng.uniform(0.05, 0.5))
                    _check_json(r, tally, action)
                except httpx.TimeoutException:
                    tally.add("left")
            else:
                bad = random_body(rng, rng.random() < 0.5, MODEL)
                url = CHAT if isinstance(bad, dict) and "messages" in bad else C
                content = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
                headers = {"content-type": "application/json"}
                async with http.stream("POST", url, content=content, headers=headers) as r:
                    raw = await r.aread()
                if r.status_code >= 500:
                    tally.fail(f"bad: {r.status_code} {raw[:200]!r}")
                elif r.status_code != 200:
                    err = json.loads(raw)
                    if set(err) != {"error"} or set(err["error"]) != ERROR_KEYS:
                        tally.fail(f"bad: error shape {err}")


async def _run_clients(base: str, seconds: float, tally: Tally) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(_client(base, seed, deadline, tally) for seed in range(CLIENTS)))


@pytest.mark.slow
def test_soak_mixed_clients(server, request):
    seconds = request.config.getoption("--soak-seconds") / 2  # each server gets half
    warm_up = min(WARM_UP_S, seconds / 4)
    tally = Tally()
    asyncio.run(_run_clients(server.base_url, warm_up, tally))
    wait_idle(server, timeout=60)
    objects_start, rss_start = python_objects(), rss_bytes()
    asyncio.run(_run_clients(server.base_url, seconds - warm_up, tally))
    wait_idle(server, timeout=60)
    objects_end, rss_end = python_objects(), rss_bytes()

    stats = server.async_engine.stats
    metrics = metric_values(server.base_url)
    print(
        f"\nsoak {seconds:.0f} s, {CLIENTS} clients: {dict(sorted(tally.counts.items()))}; "
        f"preemptions {stats['preemptions']}, prefix hits {stats['prefix_hits']}; requests "
        + str({k: v for k, v in metrics.items() if k.startswith("hybridkv_requests_total")})
        + f"; after the {warm_up:.0f} s warm-up and at the end: RSS {rss_start / 2**20:.1f} "
        f"-> {rss_end / 2**20:.1f} MiB (+{(rss_end - rss_start) / 2**20:.1f}), Python objects "
        f"{objects_start} -> {objects_end} ({objects_end - objects_start:+d})"
    )
    assert not tally.failures, tally.failures[:5]
    assert not stats["running"] and not stats["waiting"] and stats["usage"]["in_use"] == 0
    assert server.engine.cache.usage()["in_use"] == 0 and not server.engine.requests
    server.engine.cache.check_integrity()  # the engine is idle: safe from this thread
    assert not server.async_engine._streams  # every handler closed its submission
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0
    if server.engine.speculative_config is not None:
        spec = server.engine.spec_stats
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert metrics.get('hybridkv_requests_total{status="abort"}', 0) > 0
    assert rss_end - rss_start < RSS_GROWTH_BOUND
    assert objects_end - objects_start < OBJECT_GROWTH_BOUND

"""The server under bad and hostile input (issue 13): one error shape for every 4xx/5xx, one bad
request never hurts another, a request the engine gives up on fails alone, the event loop stays
responsive (big bodies, slow tokenizing), clients who leave are aborted (streaming or not), the
prompts of one request start together, log-probs in streamed chunks."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from hybridkv.engine import Engine
from tests.entrypoints.server_utils import (
    assert_error,
    delta,
    metric_values,
    post_raw,
    running_server,
    sse_events,
    wait_idle,
)

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), dtype="float32", max_num_seqs=16, max_model_len=256)
    with running_server(engine, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _stream_in_thread(base_url: str, body: dict, results: list) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
            results.append((r.status_code, sse_events(r)))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _check_stream(status: int, events: list, tokens: int) -> None:
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all("error" not in e for e in events[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] in (None, "length") for c in chunks)
    assert len(" ".join(c["choices"][0]["text"] for c in chunks).split()) >= tokens // 2


# -- 1. one error shape ----------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "t1"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        (C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
        (C, b"[" * 100_000 + b"]" * 100_000, 400, None, "nested too deeply"),
        (C, b"{not json", 400, None, "malformed JSON"),
        (C, b'{"model": "tiny", "prompt": "t1", "temperature": NaN}', 400, None, "NaN"),
        (C, b'{"model": "tiny", "prompt": "t1", "seed": ' + b"9" * 5000 + b"}", 400, None, "JSON"),
        (C, b"[1, 2]", 400, None, "must be a JSON object"),
        (C, b"", 400, None, "malformed JSON"),
        (C, {"model": "tiny"}, 400, "prompt", "prompt"),
        (C, {"model": "tiny", "prompt": [1, "t1"]}, 400, "prompt.1", "prompt.1"),
        (C, {"model": "tiny", "prompt": [[1, 2], [3, "x"]]}, 400, "prompt.1.1", "valid integer"),
        (C, {"model": "tiny", "prompt": {"a": 1}}, 400, "prompt", "list of token ids"),
        (C, {"model": "tiny", "prompt": "t1", "max_tokens": "ten"}, 400, "max_tokens", ""),
        (C, {"model": "tiny", "prompt": "t1", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        (C, {"model": "tiny", "prompt": "t1", "seed": 2**64}, 400, "seed", "seed must be"),
        (C, {"model": "tiny", "prompt": "t1", "seed": -1}, 400, "seed", "seed must be"),
        (C, {"model": "tiny", "prompt": "t1", "top_k": 2**40}, 400, "top_k", "top_k"),
        (C, {"model": "tiny", "prompt": "t1", "logprobs": 21}, 400, "logprobs", "logprobs"),
        (C, {"model": "tiny", "prompt": "t1", "stop": ["a\ud800"]}, 400, "stop", "surrogate"),
        (C, {"model": "tiny", "prompt": "a\ud800b"}, 400, "prompt", "surrogate"),
        (C, {"model": "tiny", "prompt": [1, 2**40]}, 400, "prompt", "token ids"),
        (C, {"model": "tiny", "prompt": "t1", "stop_token_ids": [2**64]}, 400,
         "stop_token_ids", ""),
        (C, {"model": "tiny", "prompt": "t1", "min_tokens": 9, "max_tokens": 2}, 400,
         "min_tokens", ""),
        (C, {"model": "tiny", "prompt": "t1", "stream_options": 5}, 400, "stream_options", ""),
        (C, {"model": "nope", "prompt": "t1"}, 404, "model", "does not exist"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
         "messages.0.content", "messages.0.content"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]}, 400,
         "messages.0.content", "surrogate"),
        (CHAT, {"model": "tiny", "messages": [USER[0], {"content": "t1"}]}, 400,
         "messages.1.role", "required"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "img"}]}]},
         400, "messages.0.content.0", "text content parts"),
        (CHAT, {"model": "tiny", "messages": []}, 400, "messages", ""),
        (CHAT, {"model": "tiny", "messages": USER, "max_completion_tokens": 0}, 400,
         "max_completion_tokens", "max_completion_tokens must be"),
        (CHAT, {"model": "tiny", "messages": USER, "max_tokens": 0}, 400, "max_tokens", ""),
        (CHAT, {"model": "tiny", "messages": USER, "max_completion_tokens": 10**6}, 400,
         "max_completion_tokens", "maximum context length"),
        (CHAT, {"model": "tiny", "messages": USER, "logprobs": True, "top_logprobs": 99}, 400,
         "top_logprobs", "top_logprobs"),
    ],
)  # fmt: skip
def test_every_error_has_one_shape(server, path, body, status, param, fragment):
    r = post_raw(server.base_url, path, body)
    assert_error(r, status, param, fragment)


def test_unknown_route_wrong_method_and_413(server):
    r = httpx.get(server.base_url + "/v1/nothing-here")
    assert_error(r, 404, None, "no route GET /v1/nothing-here")
    assert r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.base_url + "/v1/completions")
    err = assert_error(r, 405, None, "not allowed")
    assert err["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    r = httpx.delete(server.base_url + "/health")
    assert_error(r, 405)
    big = {"model": MODEL, "prompt": "t1 " * (2 * 2**20)}  # 6 MiB > the 4 MiB default
    err = assert_error(post_raw(server.base_url, C, big), 413)
    assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"t1 " * 20_000  # 60 kB each, 4.8 MB in all, no Content-Length
        yield b'"}'

    r = httpx.post(server.base_url + C, content=chunks(), timeout=60)
    assert "content-length" not in r.request.headers
    assert_error(r, 413)


def test_unexpected_exception_is_500_in_the_shape(server, monkeypatch):
    def boom(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "chat_prompt", boom)
    r = post_raw(server.base_url, CHAT, {"model": MODEL, "messages": USER})
    assert_error(r, 500, None, "a bug")
    monkeypatch.undo()
    r = post_raw(server.base_url, CHAT, {"model": MODEL, "messages": USER, "max_tokens": 2})
    assert r.status_code == 200


# -- 2. one bad request never hurts another ---------------------------------------------------


def test_bad_requests_while_streams_run(server):
    results: list = []
    body = {"model": MODEL, "prompt": "t1 t2", "max_tokens": 60, "stream": True, **GREEDY}
    threads = [_stream_in_thread(server.base_url, body, results) for _ in range(4)]
    bad = [
        (C, {"model": MODEL, "prompt": "t1", "seed": 18446744073709551616}, "seed"),
        (C, {"model": MODEL, "prompt": "a\ud800b"}, "prompt"),
        (C, {"model": MODEL, "prompt": "a\ud800b", "stream": True}, "prompt"),
        (C, {"model": MODEL, "prompt": "t1", "stop": "\udfff", "stream": True}, "stop"),
        (C, {"model": MODEL, "prompt": ["t1", "t2 \ud800"]}, "prompt"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, None),
        (C, {"model": MODEL, "prompt": "t1", "top_p": 1e308}, "top_p"),
        (C, {"model": MODEL, "prompt": "t1", "max_tokens": 2**63}, "max_tokens"),
    ]
    for _ in range(3):
        for path, body_, param in bad:
            err = assert_error(post_raw(server.base_url, path, body_), 400)
            assert param is None or err["param"] == param
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4
    for status, events in results:
        _check_stream(status, events, 60)
    wait_idle(server)
    server.engine.cache.check_integrity()


@pytest.fixture
def failing_engine(server, monkeypatch):
    """The engine gives up on requests whose prompt starts with token t77 after 3 tokens (their
    output cannot be built), as it does for a request's own failure."""
    engine = server.engine
    build = engine._output
    marker = engine.tokenizer.encode("t77")[0]

    def output(req):
        if req.prompt_token_ids[0] == marker and len(req.output_token_ids) >= 3:
            raise RuntimeError("cannot build this output")
        return build(req)

    monkeypatch.setattr(engine, "_output", output)
    return engine


def test_a_request_the_engine_gives_up_on_fails_alone(server, failing_engine):
    before = metric_values(server.base_url)
    results: list = []
    good = {"model": MODEL, "prompt": "t3 t4", "max_tokens": 30, "stream": True, **GREEDY}
    others = [_stream_in_thread(server.base_url, good, results) for _ in range(2)]
    bad = {"model": MODEL, "prompt": "t77 t1", "max_tokens": 30, **GREEDY}
    with httpx.stream("POST", server.base_url + C, json={**bad, "stream": True}) as r:
        events = sse_events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert set(events[-2]) == {"error"} and set(events[-2]["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert "cannot build this output" in events[-2]["error"]["message"]
    assert events[-2]["error"]["type"] == "server_error"
    finishes = [c["choices"][0]["finish_reason"] for c in events[:-2] if c.get("choices")]
    assert "abort" not in finishes and not any(finishes)
    r = post_raw(server.base_url, C, bad)
    assert_error(r, 500, None, "cannot build this output")
    for t in others:
        t.join(timeout=60)
    for status, events in results:
        _check_stream(status, events, 30)
    wait_idle(server)
    server.engine.cache.check_integrity()
    after = metric_values(server.base_url)
    assert delta(before, after, 'hybridkv_requests_total{status="error"}') == 2


# -- 3. the event loop stays responsive -------------------------------------------------------


def _health_latency(base_url: str) -> float:
    start = time.perf_counter()
    assert httpx.get(base_url + "/health", timeout=30).json() == {"status": "ok"}
    return time.perf_counter() - start


def test_health_answers_while_a_prompt_is_tokenized(server, monkeypatch):
    """Tokenizing runs in a worker thread: a prompt that takes 2 s to tokenize does not hold
    /health (it answered after those 2 s when tokenizing ran on the event loop)."""
    tok = server.engine.tokenizer
    encode, started = tok.encode, threading.Event()

    def slow_encode(text, *args, **kwargs):
        if text.startswith("t42 t42 t42"):
            started.set()
            time.sleep(2.0)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", slow_encode)
    out: list = []
    body = {"model": MODEL, "prompt": "t42 t42 t42 t1", "max_tokens": 2}
    thread = threading.Thread(target=lambda: out.append(post_raw(server.base_url, C, body)))
    thread.start()
    assert started.wait(30)
    latency = _health_latency(server.base_url)
    thread.join(timeout=60)
    print(f"/health during a 2 s tokenization: {latency * 1000:.1f} ms")
    assert latency < 1.0
    assert out[0].status_code == 200, out[0].text


def test_health_answers_while_big_bodies_arrive(server):
    """A 10 MB body (413, never read) and a 3.5 MB body of 700k token ids (parsed and checked
    in worker threads, then refused as too long): /health answers all the while."""
    latencies: list[float] = []
    done = threading.Event()
    out: list = []

    def big_requests() -> None:
        try:
            out.append(post_raw(server.base_url, C, {"model": MODEL, "prompt": "t1 " * 3_400_000}))
            ids = {"model": MODEL, "prompt": [5] * 700_000}
            out.append(post_raw(server.base_url, C, ids))
        finally:
            done.set()

    thread = threading.Thread(target=big_requests)
    thread.start()
    while not done.is_set():
        latencies.append(_health_latency(server.base_url))
        time.sleep(0.02)
    thread.join()
    print(f"/health during big bodies: max {max(latencies) * 1000:.1f} ms of {len(latencies)}")
    assert max(latencies) < 1.0
    assert_error(out[0], 413)
    assert_error(out[1], 400, "prompt", "max_model_len")


# -- 4. a non-streaming client who leaves is aborted ------------------------------------------


def test_non_streaming_disconnect_aborts_the_request(server, monkeypatch):
    engine = server.engine
    step = engine.step

    def slow_step():
        time.sleep(0.01)  # 200 tokens take 2 s or more: the client leaves long before
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    before = metric_values(server.base_url)
    body = json.dumps({"model": MODEL, "prompt": "t8 t9", "max_tokens": 200, **GREEDY})
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        deadline = time.time() + 30
        while not server.async_engine.stats["running"] and time.time() < deadline:
            time.sleep(0.01)
        assert server.async_engine.stats["running"] == 1
    wait_idle(server)
    engine.cache.check_integrity()
    assert engine.cache.usage()["in_use"] == 0
    after = metric_values(server.base_url)
    assert delta(before, after, 'hybridkv_requests_total{status="abort"}') == 1
    assert delta(before, after, 'hybridkv_requests_total{status="length"}') == 0
    assert delta(before, after, "hybridkv_generation_tokens_total") < 200


def test_streaming_disconnect_while_waiting_aborts(server, monkeypatch):
    """A stream whose client leaves before its first token (nothing sent yet) is aborted."""
    engine = server.engine
    step = engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    before = metric_values(server.base_url)
    body = {"model": MODEL, "prompt": "t8", "max_tokens": 200, "stream": True, **GREEDY}
    with httpx.stream("POST", server.base_url + C, json=body) as r:
        assert r.status_code == 200
    wait_idle(server)
    after = metric_values(server.base_url)
    assert delta(before, after, 'hybridkv_requests_total{status="abort"}') == 1


# -- 5. the prompts of one request start together ---------------------------------------------


def test_prompts_of_one_request_enter_the_engine_together(server, monkeypatch):
    """Every prompt of a multi-prompt request is added between the same two engine steps
    (one after another, each would start a step later than the one before)."""
    engine = server.engine
    step, add = engine.step, engine.add_request
    steps, added = [0], []

    def counting_step():
        steps[0] += 1
        return step()

    def recording_add(prompt, params, **kw):
        added.append((kw["request_id"], steps[0]))
        return add(prompt, params, **kw)

    monkeypatch.setattr(engine, "step", counting_step)
    monkeypatch.setattr(engine, "add_request", recording_add)
    prompts = ["t1 t2", "t3", "t4 t5 t6", "t7"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 8, **GREEDY}
    r = post_raw(server.base_url, C, body)
    assert r.status_code == 200, r.text
    assert len(added) == 4 and len({s for _, s in added}) == 1, added
    together = [c["text"] for c in r.json()["choices"]]
    added.clear()
    with httpx.stream("POST", server.base_url + C, json={**body, "stream": True}) as s:
        events = sse_events(s)
    assert len(added) == 4 and len({s for _, s in added}) == 1, added
    streamed = [""] * 4
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == together
    # each prompt alone gives the same text (greedy)
    for p, text in zip(prompts, together, strict=True):
        alone = post_raw(server.base_url, C, {**body, "prompt": p}).json()
        assert alone["choices"][0]["text"] == text


# -- 6. log-probs in streamed chunks ----------------------------------------------------------


def test_streamed_completion_logprobs(client):
    kw = dict(model=MODEL, prompt="t1 t2 t3", max_tokens=8, logprobs=3, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        lp = chunk.choices[0].logprobs
        assert lp is not None
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert len(lp.text_offset) == len(lp.tokens)
        tokens += lp.tokens
        token_logprobs += lp.token_logprobs
        tops += lp.top_logprobs
        offsets += lp.text_offset
    assert tokens == whole.tokens and len(tokens) == 8
    assert token_logprobs == pytest.approx(whole.token_logprobs, abs=1e-5)
    assert [set(t) for t in tops] == [set(t) for t in whole.top_logprobs]
    assert offsets == whole.text_offset


def test_streamed_chat_logprobs(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "t5 t6"}],
        max_tokens=7,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    content = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
    assert [c.token for c in content] == [c.token for c in whole] and len(content) == 7
    assert [c.logprob for c in content] == pytest.approx([c.logprob for c in whole], abs=1e-5)
    for c in content:
        assert c.bytes == list(c.token.encode()) and 1 <= len(c.top_logprobs) <= 3
    # no log-probs asked: none sent
    kw.pop("logprobs"), kw.pop("top_logprobs")
    assert all(
        not ch.choices or ch.choices[0].logprobs is None
        for ch in client.chat.completions.create(stream=True, **kw)
    )


def test_health_reports_a_dead_engine_loop(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), dtype="float32", max_num_seqs=2, max_model_len=64)
    with running_server(engine, MODEL) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        srv.async_engine.shutdown()
        assert_error(httpx.get(srv.base_url + "/health"), 503, None, "engine")
        r = post_raw(srv.base_url, C, {"model": MODEL, "prompt": "t1", "max_tokens": 2})
        assert_error(r, 503, None, "not running")

"""Data-parallel replicas on Ray Serve (hybridkv.serving.ray_app): two replicas of the default
model behind the ingress on a local Ray cluster, driven with the openai SDK."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from hybridkv.serving.ray_app import REPLICA_HEADER, build_app, init_ray, run_app  # noqa: E402

MODEL_NAME = "hybridkv-default"
ENGINE_KWARGS = {"max_model_len": 1024, "max_num_seqs": 8}
# longer than two hash blocks (144 tokens each for the default model): a prefix to stick to
SYSTEM = " ".join(f"Rule {k}: answer briefly and politely, citing rule {k}." for k in range(12))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base: str, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base}/health", timeout=2)
            if r.status_code == 200 and len(r.json()["replicas"]) == replicas:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{replicas} replicas not serving after {timeout}s")


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    port = _free_port()
    init_ray(num_cpus=2, configure_logging=False)
    try:
        app = build_app(None, 2, "prefix_aware", ENGINE_KWARGS, MODEL_NAME)
        start = time.monotonic()
        run_app(app, {"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, 2, 120)
        print(f"\nray serve app up in {time.monotonic() - start:.1f}s")
        yield url
    finally:
        # the cluster is this fixture's: stopping it ends every replica, the proxy and the
        # controller at once (serve.shutdown first would wait ~5 s for each graceful stop)
        ray.shutdown()


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_and_chat(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens >= 1
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 0


def test_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_errors_keep_the_server_shape(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=-1)
    err = info.value.body
    assert info.value.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=1)
    r = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{base}/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL_NAME
    tok = httpx.post(f"{base}/tokenize", json={"prompt": "Hello"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0


def _chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, str, int]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0
    )
    out = raw.parse()
    cached = out.usage.prompt_tokens_details.cached_tokens or 0
    return raw.headers[REPLICA_HEADER], out.choices[0].message.content or "", cached


def test_conversations_stick_to_their_replica(client: openai.OpenAI) -> None:
    seen: set[str] = set()
    for c in range(3):
        messages = [{"role": "system", "content": f"Conversation {c}. {SYSTEM}"}]
        replica = None
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {c}?"})
            rid, text, cached = _chat(client, messages)
            messages.append({"role": "assistant", "content": text})
            if replica is None:
                replica = rid
            assert rid == replica, f"conversation {c} turn {turn} moved {replica} -> {rid}"
            assert turn == 0 or cached >= 144, f"conversation {c} turn {turn}: {cached} cached"
            time.sleep(0.3)  # the ingress polls the cache events every ~100 ms
        seen.add(replica)
    print(f"\nconversations on {sorted(seen)}")


def test_metrics_cover_every_replica(client: openai.OpenAI, base: str) -> None:
    for k in range(4):  # requests on both replicas (round robin breaks ties when nothing hits)
        client.completions.create(model=MODEL_NAME, prompt=f"metrics {k}", max_tokens=2)
    text = httpx.get(f"{base}/metrics", timeout=30).text
    assert 'hybridkv_ingress_replica_up{replica="replica-0"} 1.0' in text
    assert 'hybridkv_ingress_replica_up{replica="replica-1"} 1.0' in text
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a metric family declared twice"
    lines = [line for line in text.splitlines() if line.startswith("hybridkv_requests_total")]
    for rid in ("replica-0", "replica-1"):
        assert any(f'replica="{rid}"' in line for line in lines), (rid, lines)
    pinned = httpx.get(f"{base}/metrics", headers={REPLICA_HEADER: "replica-1"}, timeout=30)
    assert pinned.headers[REPLICA_HEADER] == "replica-1"
    assert "replica=" not in pinned.text and "hybridkv_" in pinned.text


def _replica_actor(rid: str):
    k = rid.rsplit("-", 1)[1]
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::") and f"#hybridkv-replica-{k}#" in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise AssertionError(f"no actor for {rid}")


def test_a_replica_dying_mid_stream(client: openai.OpenAI, base: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 900,
            "ignore_eos": True, "stream": True}  # fmt: skip
    events: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        rid = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    break
        ray.kill(_replica_actor(rid), no_restart=False)
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and rid in error["message"]
    # the next requests are served (by the other replica while this one restarts)
    for _ in range(2):
        out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
        assert out.usage.completion_tokens == 3
    # Ray Serve restarts the replica and it rejoins routing
    start = time.monotonic()
    _wait_healthy(base, 2, 300)  # (a restart takes minutes on a loaded machine)
    print(f"\n{rid} back in routing {time.monotonic() - start:.1f}s after the next requests")

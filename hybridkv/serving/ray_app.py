"""Data-parallel replicas on Ray Serve: N hybridkv engines behind one OpenAI-compatible ingress.

    client --HTTP--> Ray Serve proxy --> HybridKVIngress (FastAPI, one actor)
                                            | tokenize the prompt (chat template as the server)
                                            | Router.choose(ids, loads) -> "replica-k"
                                            v
                       hybridkv-replica-k (one deployment of one replica per k; an Engine and
                       the `hybridkv serve` app inside) <-- poll(): load + cache events, ~100 ms

Each replica runs the full `hybridkv serve` FastAPI app in-process (`Server` + `build_app`); the
ingress forwards the raw method, path, headers and body and relays status, headers and body (or
the event stream) back, so every endpoint, error shape and status code is the one
`hybridkv serve` gives. One deployment per replica makes each replica addressable (the prefix
router picks one); Ray Serve restarts a dead one, which rejoins routing when it answers a poll
(with a new instance id: the prefix index forgets what its predecessor cached).

Faults: a replica whose actor dies is taken out of routing and the index forgets it; a request
in flight on it fails cleanly: 503 in OpenAI's error shape (Anthropic's on /v1/messages) before
the response started, or, in a stream already started, a `data: {"error": ...}` event and
`data: [DONE]`.
"""

# No `from __future__ import annotations`: FastAPI reads the ingress routes' annotations
# (Request) at runtime, through serve.ingress's rewritten signatures.
import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from hybridkv.serving.metrics import merge as merge_metrics
from hybridkv.serving.router import IndexSpec, ReplicaLoad, Router

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-hybridkv-replica"
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
POLICIES = ("prefix_aware", "least_loaded", "round_robin")
POLL_INTERVAL_S = 0.1
POLL_TIMEOUT_S = 2.0
MAX_BUFFERED_EVENTS = 1_000_000
# Ray Serve's controller kills a proxy that does not answer its first ready check within
# RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s), and serve.start then fails ("The actor is dead
# because it was killed by `ray.kill`"): on a small machine busy with replicas importing torch,
# or loaded otherwise, the proxy's start takes longer (seen: one core shared with other work).
# A local cluster started by `init_ray` gets these instead; a value the user set wins.
LOCAL_RAY_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
}
# request headers not forwarded (hop-by-hop, or recomputed by the replica's app)
_DROP_REQUEST = {"host", "connection", "transfer-encoding", "keep-alive", "upgrade"}
# response headers not relayed (the ingress's response computes its own)
_DROP_RESPONSE = {"content-length", "transfer-encoding", "connection", "date", "server"}
# the routes whose prompt picks a replica by prefix; the others go to the least loaded
_COMPLETIONS, _CHAT = "/v1/completions", "/v1/chat/completions"

try:  # Ray's "the replica is gone (for now)" errors besides RayActorError
    from ray.exceptions import ActorUnavailableError

    _REPLICA_GONE: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)
except ImportError:  # pragma: no cover - older Ray
    _REPLICA_GONE = (RayActorError,)


def _model_folder(model: str | None) -> Path:
    from hybridkv.engine import DEFAULT_MODEL

    return Path(model) if model else DEFAULT_MODEL


# ---------------------------------------------------------------------------------------------
# Replica: one engine and the `hybridkv serve` app
# ---------------------------------------------------------------------------------------------


class _Call:
    """One in-process ASGI call of the replica's app; its response messages on a queue."""

    def __init__(self, app: Any, method: str, path: str, headers: Sequence[tuple[str, str]],
                 body: bytes) -> None:  # fmt: skip
        path, _, query = path.partition("?")
        self.scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method.upper(), "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query.encode(),
            "root_path": "", "client": ("ray-ingress", 0), "server": ("hybridkv-replica", 0),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        }  # fmt: skip
        self.app, self.body = app, body
        self.sent_body = False
        self.gone = asyncio.Event()  # the caller left: the app sees http.disconnect
        self.queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        await self.queue.put(message)

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.receive, self.send)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await self.queue.put(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            await self.queue.put(None)

    async def messages(self) -> AsyncIterator[dict[str, Any] | bytes]:
        """{"status", "headers"} once, then the body's chunks (bytes)."""
        task = asyncio.create_task(self.run())
        started = False
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    if started:
                        raise item
                    msg = f"internal server error: {item!r}"
                    yield {"status": 500, "headers": [("content-type", "application/json")]}
                    yield json.dumps(_error_body(500, msg)).encode()
                    return
                if item["type"] == "http.response.start":
                    started = True
                    headers = [(k.decode("latin-1"), v.decode("latin-1"))
                               for k, v in item.get("headers", [])]  # fmt: skip
                    yield {"status": item["status"], "headers": headers}
                elif item["type"] == "http.response.body":
                    if item.get("body"):
                        yield bytes(item["body"])
                    if not item.get("more_body", False):
                        return
        finally:
            self.gone.set()  # the caller left, or the response ended: the app lets go
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
            if not task.done():
                task.cancel()


class ReplicaCore:
    """The replica's work without Ray (the deployment below wraps it; tests can use it as is)."""

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any] | None = None,
        model_name: str = "hybridkv-default",
        server_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from hybridkv.engine import Engine
        from hybridkv.entrypoints.server import Server, build_app

        self.instance = uuid.uuid4().hex  # a restarted replica is a new instance
        engine = Engine(model, **(engine_kwargs or {}))
        self.server = Server(engine, model_name, **(server_kwargs or {}))
        self.app = build_app(self.server)
        # Cache events are drained on the engine thread (the only one touching the cache),
        # after each step's stats, into a buffer the poll takes.
        self._events: list[Any] = []
        self._events_lock = threading.Lock()
        cache = engine.cache
        self.events_enabled = hasattr(cache, "enable_events") and hasattr(cache, "drain_events")
        if self.events_enabled:
            cache.enable_events()
            ae = self.server.async_engine
            publish = ae._publish_stats

            def publish_and_drain() -> None:  # on the engine thread
                publish()
                events = cache.drain_events()
                with self._events_lock:
                    if len(self._events) + len(events) > MAX_BUFFERED_EVENTS:
                        self._events.clear()  # nobody polls: the next drain resynchronises
                        log = getattr(cache, "_events", None)
                        if log is not None:
                            log.overflowed = True
                    else:
                        self._events.extend(events)

            ae._publish_stats = publish_and_drain  # type: ignore[method-assign]

    # -- requests ------------------------------------------------------------------------------

    def forward(self, method: str, path: str, headers: Sequence[tuple[str, str]],
                body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:  # fmt: skip
        """The app's response to one HTTP request: {"status", "headers"}, then body chunks."""
        return _Call(self.app, method, path, headers, body).messages()

    async def call_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` as JSON: {"status": int, "body": the JSON answer}."""
        head: dict[str, Any] = {}
        chunks: list[bytes] = []
        async for item in self.forward("POST", path, _JSON_HEADERS, json.dumps(body).encode()):
            if isinstance(item, dict):
                head = item
            else:
                chunks.append(item)
        return {"status": head.get("status", 500), "body": json.loads(b"".join(chunks) or b"{}")}

    async def call_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
        """POST `body` with stream=true: the SSE events as strings ("data: ...\\n\\n"); an
        error before the stream started comes as one error event and [DONE]."""
        body = {**body, "stream": True}
        status = 200
        pending = ""
        async for item in self.forward("POST", path, _JSON_HEADERS, json.dumps(body).encode()):
            if isinstance(item, dict):
                status = item["status"]
                continue
            if status != 200:
                pending += item.decode()
                continue
            pending += item.decode()
            *events, pending = pending.split("\n\n")
            for e in events:
                yield e + "\n\n"
        if status != 200:
            yield f"data: {pending}\n\n"
            yield "data: [DONE]\n\n"
        elif pending:
            yield pending

    # -- state -------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        """This replica's /metrics (Prometheus text)."""
        return self.server.metrics.render().decode()

    def load(self) -> dict[str, int]:
        """ReplicaLoad's fields, from the engine thread's last published stats."""
        stats = self.server.async_engine.stats
        usage = stats.get("usage", {})
        return {
            "num_running": int(stats.get("running", 0)),
            "num_waiting": int(stats.get("waiting", 0)),
            "free_pages": int(usage.get("free", 0)) + int(usage.get("cached", 0)),
            "total_pages": int(usage.get("total", 0)),
        }

    def drain_cache_events(self) -> list[Any]:
        """The cache events since the last call (drained from the cache on the engine thread
        after every step); [] when the cache manager has no events."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def poll(self) -> dict[str, Any]:
        """What the ingress polls: instance id, load, cache events since the last poll."""
        return {
            "instance": self.instance,
            "load": self.load(),
            "events": self.drain_cache_events(),
            "alive": self.server.async_engine.alive,
        }

    def index_plan(self) -> Any:
        """The engine's memory plan (the ingress builds its IndexSpec from it)."""
        return self.server.engine.plan

    def health(self) -> dict[str, Any]:
        eng = self.server.async_engine
        return {"alive": eng.alive, "fatal": eng.fatal, "instance": self.instance}


_JSON_HEADERS = (("content-type", "application/json"),)


@serve.deployment(
    ray_actor_options={"num_cpus": 0.5},
    health_check_period_s=2.0,
    health_check_timeout_s=30.0,
    max_ongoing_requests=256,
)
class HybridKVReplica:
    """One hybridkv engine (its `Server` built in this actor). Streaming methods are called with
    `handle.options(stream=True)`."""

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any],
        model_name: str,
        server_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.core = ReplicaCore(model, engine_kwargs, model_name, server_kwargs)
        self.server = self.core.server

    async def forward(self, method: str, path: str, headers: list[tuple[str, str]],
                      body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:  # fmt: skip
        async for item in self.core.forward(method, path, headers, body):
            yield item

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.core.call_json(_COMPLETIONS, body)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.core.call_json(_CHAT, body)

    async def completion_stream(self, body: dict[str, Any]) -> AsyncIterator[str]:
        async for event in self.core.call_stream(_COMPLETIONS, body):
            yield event

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[str]:
        async for event in self.core.call_stream(_CHAT, body):
            yield event

    def load(self) -> dict[str, int]:
        return self.core.load()

    def drain_cache_events(self) -> list[Any]:
        return self.core.drain_cache_events()

    def poll(self) -> dict[str, Any]:
        return self.core.poll()

    def index_plan(self) -> Any:
        return self.core.index_plan()

    def metrics_text(self) -> str:
        return self.core.metrics_text()

    def health(self) -> dict[str, Any]:
        return self.core.health()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped is restarted."""
        if not self.server.async_engine.alive:
            raise RuntimeError(f"the engine loop stopped: {self.server.async_engine.fatal}")


# ---------------------------------------------------------------------------------------------
# Ingress: route, forward, relay
# ---------------------------------------------------------------------------------------------


def _error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    from hybridkv.entrypoints.protocol import OpenAIError

    return OpenAIError(message, status, code=code).body()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _ChatPrompts:
    """`Server.chat_prompt` (the server's chat template rendering) without an engine."""

    def __init__(self, folder: Path) -> None:
        from hybridkv.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(folder)
        self.engine = SimpleNamespace(tokenizer=self.tokenizer)
        self._template = None

    from hybridkv.entrypoints.server import Server as _Server

    template = _Server.template
    _chat_message = staticmethod(_Server._chat_message)
    chat_prompt = _Server.chat_prompt
    del _Server


def prompt_keys(prompts: _ChatPrompts, path: str, body: bytes) -> tuple[list[int], tuple]:
    """The token ids of the (first) prompt of a completion or chat request, and its extra
    keys (a cache salt); ([], ()) when it cannot tell (the replica reports any error)."""
    if prompts.tokenizer is None or path not in (_COMPLETIONS, _CHAT):
        return [], ()
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            return [], ()
        salt = data.get("cache_salt")
        extra = (("cache_salt", salt),) if isinstance(salt, str) else ()
        if path == _COMPLETIONS:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: the first prompt
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt), extra
            if isinstance(prompt, str):
                return prompts.tokenizer.encode(prompt, add_special_tokens=True), extra
            return [], ()
        from hybridkv.entrypoints.protocol import ChatCompletionRequest

        chat = ChatCompletionRequest.model_validate(data)
        text = prompts.chat_prompt(chat, chat.tools)
        return prompts.tokenizer.encode(text, add_special_tokens=False), extra
    except Exception:  # noqa: BLE001 - not ours to judge: the replica answers it
        return [], ()


def _relayed(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in headers if k.lower() not in _DROP_RESPONSE]


# serve.ingress pickles the routes when the class below is decorated: what they use is
# defined above it.
ingress_app = FastAPI(title="hybridkv (Ray Serve)", version="0.1.0")


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
@serve.ingress(ingress_app)
class HybridKVIngress:
    def __init__(
        self,
        replicas: list[DeploymentHandle],
        model: str | None,
        policy: str,
        max_request_bytes: int | None = None,
    ) -> None:
        from hybridkv.entrypoints.server import DEFAULT_MAX_REQUEST_BYTES

        self.ids = [f"replica-{k}" for k in range(len(replicas))]
        self.handles = dict(zip(self.ids, replicas, strict=True))
        self.streams = {r: h.options(stream=True) for r, h in self.handles.items()}
        self.policy = policy
        self.router: Router | None = None  # built when the first replica answers (its plan)
        self.prompts = _ChatPrompts(_model_folder(model))
        self.max_request_bytes = max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
        self.loads: dict[str, ReplicaLoad] = {}
        self.instances: dict[str, str] = {}
        self.up: set[str] = set()  # replicas in routing (answered their last poll)
        self.round = itertools.count()
        self._poller = asyncio.get_event_loop().create_task(self._poll_forever())

    # -- replica state ---------------------------------------------------------------------------

    def mark_down(self, rid: str, why: str) -> None:
        if rid in self.up:
            logger.warning("replica %s out of routing: %s", rid, why)
        self.up.discard(rid)
        self.loads.pop(rid, None)
        self.instances.pop(rid, None)
        if self.router is not None:
            self.router.remove_replica(rid)  # its index entry goes too

    async def _poll_one(self, rid: str) -> None:
        try:
            state = await asyncio.wait_for(self.handles[rid].poll.remote(), POLL_TIMEOUT_S)
        except _REPLICA_GONE as exc:
            self.mark_down(rid, repr(exc))
            return
        except Exception as exc:  # noqa: BLE001 - starting (a timeout), or gone
            if rid in self.up:
                self.mark_down(rid, f"no answer to a poll: {exc!r}")
            return
        if not state.get("alive", True):
            self.mark_down(rid, "its engine loop stopped")
            return
        if self.router is None:
            plan = await asyncio.wait_for(self.handles[rid].index_plan.remote(), POLL_TIMEOUT_S)
            self.router = Router(self.policy, [rid], spec=IndexSpec.from_plan(plan))
        if self.instances.get(rid) != state["instance"]:
            # new, or restarted: what an old instance cached is gone (its first events are
            # CLEARED and the whole cache)
            self.router.remove_replica(rid)
            self.router.add_replica(rid)
            self.instances[rid] = state["instance"]
            logger.info("replica %s in routing (instance %s)", rid, state["instance"][:8])
        elif rid not in self.router.replicas:
            self.router.add_replica(rid)
        if state["events"]:
            self.router.apply(rid, state["events"])
        self.loads[rid] = ReplicaLoad(**state["load"])
        self.up.add(rid)

    async def _poll_forever(self) -> None:
        while True:
            start = time.monotonic()
            try:
                await asyncio.gather(*(self._poll_one(r) for r in self.ids))
            except Exception:  # noqa: BLE001 - keep polling
                logger.exception("polling the replicas failed")
            await asyncio.sleep(max(0.0, POLL_INTERVAL_S - (time.monotonic() - start)))

    async def choose(self, path: str, body: bytes) -> str | None:
        for _ in range(600):  # up to ~60 s for a replica to come (back) up
            if self.up:
                break
            await asyncio.sleep(0.1)
        live = {r: self.loads[r] for r in self.ids if r in self.up and r in self.loads}
        if not live or self.router is None:
            return None
        if path in (_COMPLETIONS, _CHAT):
            ids, extra = await asyncio.to_thread(prompt_keys, self.prompts, path, body)
        else:
            ids, extra = [], ()
        return self.router.choose(ids, live, extra_keys=extra)

    # -- requests ------------------------------------------------------------------------------

    @ingress_app.get("/health")
    async def health(self) -> Response:
        if not self.up:
            return JSONResponse(_error_body(503, "no replica is serving"), status_code=503)
        return JSONResponse({"status": "ok", "replicas": sorted(self.up)})

    @ingress_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every replica in routing's metrics, labelled by replica (`x-hybridkv-replica` asks
        one replica alone, as for any path)."""
        if request.headers.get(REPLICA_HEADER) is not None:
            return await self.relay(request, "/metrics")
        live = [r for r in self.ids if r in self.up]
        asks = [self.handles[r].metrics_text.remote() for r in live]
        answers = await asyncio.gather(
            *(asyncio.wait_for(a, POLL_TIMEOUT_S) for a in asks), return_exceptions=True
        )
        texts = {r: a for r, a in zip(live, answers, strict=True) if isinstance(a, str)}
        up = {r: r in texts for r in self.ids}
        return Response(merge_metrics(texts, up), media_type=_PROMETHEUS)

    @ingress_app.api_route(
        "/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    )
    async def relay(self, request: Request, path: str) -> Response:
        path = request.url.path
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            from hybridkv.entrypoints.server import _too_large

            err = _too_large(int(declared), self.max_request_bytes)
            return self._error(path, err.status, err.message, err.code)
        body = await request.body()
        rid = request.headers.get(REPLICA_HEADER)  # a client may pin a replica (/metrics)
        if rid not in self.up:
            rid = await self.choose(path, body)
        if rid is None:
            return self._error(path, 503, "no replica is serving", None)
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        gen = self.streams[rid].forward.remote(request.method, target, headers, body)
        try:
            head = await gen.__anext__()
        except _REPLICA_GONE as exc:
            self.mark_down(rid, repr(exc))
            return self._error(path, 503, f"replica {rid} failed: {type(exc).__name__}", rid)
        except Exception as exc:  # noqa: BLE001
            return self._error(path, 503, f"replica {rid} failed: {exc!r}", rid)
        status, out = head["status"], dict(_relayed(head["headers"]))
        out[REPLICA_HEADER] = rid
        media = out.pop("content-type", None)
        if media is not None and media.startswith("text/event-stream"):
            return StreamingResponse(self._relay_stream(rid, gen), status, out, media)
        try:
            chunks = [c async for c in gen]
        except _REPLICA_GONE as exc:
            self.mark_down(rid, repr(exc))
            return self._error(path, 503, f"replica {rid} failed: {type(exc).__name__}", rid)
        return Response(b"".join(chunks), status, out, media)

    async def _relay_stream(self, rid: str, gen: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the replica died mid-stream
            if isinstance(exc, _REPLICA_GONE):
                self.mark_down(rid, repr(exc))
            msg = f"replica {rid} failed during the stream: {type(exc).__name__}"
            yield _sse(_error_body(503, msg)).encode()
            yield _sse("[DONE]").encode()
        finally:
            with contextlib.suppress(Exception):
                gen.cancel()

    def _error(self, path: str, status: int, message: str, rid: str | None,
               code: str | None = None) -> JSONResponse:  # fmt: skip
        headers = {REPLICA_HEADER: rid} if rid else None
        if path == "/v1/messages":
            from hybridkv.entrypoints.adapters import anthropic_error

            return JSONResponse(anthropic_error(status, message), status, headers)
        return JSONResponse(_error_body(status, message, code), status, headers)


# ---------------------------------------------------------------------------------------------
# The application
# ---------------------------------------------------------------------------------------------


def build_app(
    model: str | None,
    num_replicas: int,
    policy: str = "prefix_aware",
    engine_kwargs: dict[str, Any] | None = None,
    model_name: str = "hybridkv-default",
    *,
    server_kwargs: dict[str, Any] | None = None,
    replica_cpus: float = 0.5,
    ingress_cpus: float = 0.25,
) -> serve.Application:
    """`num_replicas` hybridkv engines (deployments "hybridkv-replica-k") behind the ingress
    "hybridkv-ingress"; `policy`: prefix_aware, least_loaded or round_robin. `server_kwargs`
    go to `Server` (max_request_bytes, tool_parser, reasoning_parser)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
    server_kwargs = dict(server_kwargs or {})
    replicas = [
        HybridKVReplica.options(
            name=f"hybridkv-replica-{k}", ray_actor_options={"num_cpus": replica_cpus}
        ).bind(model, dict(engine_kwargs or {}), model_name, server_kwargs)
        for k in range(num_replicas)
    ]
    return HybridKVIngress.options(
        name="hybridkv-ingress", ray_actor_options={"num_cpus": ingress_cpus}
    ).bind(replicas, model, policy, server_kwargs.get("max_request_bytes"))


# ---------------------------------------------------------------------------------------------
# `hybridkv serve --data-parallel-size N [--ray-address ADDR] [--routing-policy P]`
# ---------------------------------------------------------------------------------------------


def engine_kwargs_of(args: Any) -> dict[str, Any]:
    """The Engine keyword arguments of `hybridkv serve`'s model flags, less tensor
    parallelism (refused together with data parallelism)."""
    from hybridkv.entrypoints.cli import engine_kwargs

    kwargs = engine_kwargs(args)
    for name in ("tensor_parallel_size", "distributed_timeout_s"):
        kwargs.pop(name)
    return kwargs


def init_ray(address: str | None = None, **kwargs: Any) -> None:
    """`ray.init` without the dashboard or workers' logs on the driver. Starting a local
    cluster (`address` None) sets `LOCAL_RAY_ENV` where unset, before Ray's processes start
    (they take their environment from this one); a cluster joined by address keeps its own."""
    import ray

    if address is None:
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
    ray.init(address=address, include_dashboard=False, log_to_driver=False, **kwargs)


def run_app(
    app: serve.Application, http_options: dict[str, Any], deadline_s: float = 300.0
) -> None:
    """`serve.start` then `serve.run(app)`, waiting up to `deadline_s` for Ray Serve's proxies.

    Both calls give up after Ray Serve's fixed 60 s (HTTP_PROXY_TIMEOUT, not configurable) if
    the proxies are not serving; on a slow or busy machine their start takes longer, while the
    controller and the proxies it started keep starting. A call after such a timeout finds them
    (serve.start connects to the running controller; serve.run deploys the same app again), so
    each call is repeated until the deadline."""
    deadline = time.monotonic() + deadline_s
    for call in (
        lambda: serve.start(http_options=http_options),
        lambda: serve.run(app, name="hybridkv", route_prefix="/"),
    ):
        while True:
            try:
                call()
                break
            except TimeoutError as err:
                if time.monotonic() >= deadline:
                    raise
                logger.warning("Ray Serve is still starting (%s); waiting", err)


def run_cli(args: Any, max_request_bytes: int) -> int:
    """Start (or join, `args.ray_address`) Ray, run the app on args.host:args.port and block
    until interrupted. Returns the exit status."""
    import ray

    num = args.data_parallel_size
    name = args.served_model_name or args.model or "hybridkv-default"
    server_kwargs = {
        "max_request_bytes": max_request_bytes,
        "tool_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
    }
    start = time.monotonic()
    init_ray(args.ray_address)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    replica_cpus = min(1.0, round(cpus / (num + 1), 2))  # room for the ingress
    app = build_app(
        args.model, num, args.routing_policy, engine_kwargs_of(args), name,
        server_kwargs=server_kwargs, replica_cpus=replica_cpus,
        ingress_cpus=min(0.25, replica_cpus),
    )  # fmt: skip
    try:
        run_app(app, {"host": args.host, "port": args.port})
        print(
            f"serving {name} on http://{args.host}:{args.port} with {num} replica(s) on Ray "
            f"({args.routing_policy} routing), up in {time.monotonic() - start:.1f}s",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        with contextlib.suppress(Exception):
            if args.ray_address is None:
                serve.shutdown()
            else:  # a shared cluster: take down this app only
                serve.delete("hybridkv")
        ray.shutdown()

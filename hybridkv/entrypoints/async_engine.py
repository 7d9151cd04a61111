"""The engine in a background thread, fed by asyncio request handlers.

    handlers (event loop)                     engine thread
    ---------------------                     -------------
    submit(prompt, params) --("add")------->  engine.add_request
    async for out in stream:   <--outputs--   engine.step()  (concurrent clients batch together)
    client gone / cancelled --("abort")---->  engine.abort   (pages return to the pool)

Only the engine thread touches the engine. After every step it publishes a stats snapshot,
which the /metrics endpoint reads without touching live engine structures.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hybridkv.engine import Engine
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self.stats: dict[str, Any] = {}
        self.finished: list[RequestOutput] = []  # drained by the metrics collector
        self._finished_lock = threading.Lock()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    # -- handler side ------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, prefix: str = "req"
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (one per step it advances); aborts it if the consumer
        stops early (client disconnect, cancellation)."""
        request_id = f"{prefix}-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt, params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_commands(block=not self.engine.has_unfinished)
            if self.engine.has_unfinished:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # an engine bug must not kill the server silently
                    self._fail_all(exc)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
                    if out.finished:
                        with self._finished_lock:
                            self.finished.append(out)
                self._publish_stats()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params = cmd
            try:
                self.engine.add_request(prompt, params, request_id=request_id, stream=True)
            except ValueError as exc:
                self._deliver(request_id, exc)
        elif kind == "abort":
            self.engine.abort(cmd[1])
            self._publish_stats()

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, RuntimeError(f"engine error: {exc}"))

    def _publish_stats(self) -> None:
        eng = self.engine
        self.stats = {
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "usage": eng.cache.usage(),
            "groups": eng.cache.group_usage(),
            "prefix_queries": eng.cache.stats.queries,
            "prefix_hits": eng.cache.stats.hits,
            "prefix_query_tokens": eng.cache.stats.query_tokens,
            "prefix_hit_tokens": eng.cache.stats.hit_tokens,
            "preemptions": eng.scheduler.num_preemptions,
        }

    def drain_finished(self) -> list[RequestOutput]:
        with self._finished_lock:
            out, self.finished = self.finished, []
        return out

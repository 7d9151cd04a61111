"""The engine in a background thread, fed by asyncio request handlers.

    handlers (event loop)                        engine thread
    ---------------------                        -------------
    sub = await submit(prompts, params) --add-->  engine.add_request for each (all or none,
                                                  between two steps: they start together)
    async for k, out in sub.outputs():  <------  engine.step()  (concurrent clients batch)
    sub.close() (client gone, error) --abort--->  engine.abort   (pages return to the pool)

Only the engine thread touches the engine. After every step it publishes a stats snapshot,
which the /metrics endpoint reads without touching live engine structures; it hands finished
and aborted requests to `on_finished` / `on_aborted` (the metrics) and keeps nothing of them.
A request the engine gives up on (`RequestOutput.error`) raises `RequestFailed` in its handler
alone; an error of the loop itself fails the requests in the engine and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hybridkv.distributed.runtime import TensorParallelError
from hybridkv.engine import Engine
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ACCEPTED = object()  # the engine added every request of a submission


class RequestFailed(Exception):
    """The engine gave up on a request (`RequestOutput.error`), or could not serve it."""


class Submission:
    """The engine requests of one client request: added together, their outputs on one queue.

    `close()` aborts those not finished (idempotent); handlers call it when they are done,
    whatever happened, so that a client who left or an error never leaves pages behind."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(range(len(request_ids)))
        self.closed = False

    def put(self, item: Any) -> None:
        """From the engine thread: hand an item to the handler's event loop."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index of the prompt, output) as they come, until every request finished. A
        request the engine gave up on raises RequestFailed."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            k, out = item
            if out.finished:
                self.unfinished.discard(k)
                if out.error is not None or out.finish_reason == "abort":
                    raise RequestFailed(out.error or "the engine aborted this request")
            yield k, out

    async def results(self) -> list[RequestOutput]:
        """The final output of every request, in prompt order."""
        last: list[Any] = [None] * len(self.request_ids)
        async for k, out in self.outputs():
            last[k] = out
        return last

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._engine._close(self)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[Submission, int]] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self.stats: dict[str, Any] = {}
        # called on the engine thread: a finished output; an aborted request's prompt and
        # generated token counts
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.on_aborted: Callable[[int, int], None] | None = None
        # a fatal engine error (a tensor-parallel rank died or hung): the loop stops, every
        # request fails, and `on_fatal` (the server: shut down, exit non-zero) is told
        self.fatal: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    # -- handler side ------------------------------------------------------------------------

    async def submit(
        self,
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        prefix: str = "req",
        options: Sequence[dict[str, Any]] | None = None,
    ) -> Submission:
        """Add one request per prompt, all in the same pause between two engine steps (they
        are scheduled together), and wait until the engine took them. The engine's ValueError
        for a bad prompt or params is raised here, and then none of them was added.
        `options[k]`: add_request keywords of prompt k: "extra_keys", and "after" as the index
        of an earlier prompt of this submission (held until that one's prompt is computed)."""
        if len(prompts) != len(params):
            raise ValueError("one SamplingParams per prompt")
        if not self.alive:
            raise RequestFailed("the engine is not running")
        ids = [f"{prefix}-{next(self._ids)}" for _ in prompts]
        sub = Submission(self, ids)
        for k, request_id in enumerate(ids):
            self._streams[request_id] = (sub, k)
        opts = [dict(o) for o in options] if options is not None else [{} for _ in prompts]
        for o in opts:
            if o.get("after") is not None:
                o["after"] = ids[o["after"]]
        items = list(zip(ids, prompts, params, opts, strict=True))
        self._commands.put(("add", sub, items))
        try:
            item = await sub.queue.get()
        except BaseException:  # cancelled while waiting: whatever was added is aborted
            sub.close()
            raise
        if item is not _ACCEPTED:
            sub.close()
            raise item
        return sub

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, prefix: str = "req"
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (one per step it advances); aborts it if the consumer
        stops early (client disconnect, cancellation)."""
        sub = await self.submit([prompt], [params], prefix)
        try:
            async for _, out in sub.outputs():
                yield out
        finally:
            sub.close()

    def _close(self, sub: Submission) -> None:
        for request_id in sub.request_ids:
            self._streams.pop(request_id, None)
        unfinished = [sub.request_ids[k] for k in sorted(sub.unfinished)]
        if unfinished:
            self._commands.put(("abort", unfinished))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.shutdown()  # the other tensor-parallel ranks, if any

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._drain_commands(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished and not self._stopped.is_set():
                    outputs = self.engine.step()
                    for out in outputs:
                        self._deliver(out)
                    self._publish_stats()
            except TensorParallelError as exc:  # the engine cannot go on
                logger.error("engine stopped: %s", exc)
                self.fatal = str(exc)
                self._stopped.set()
                self._fail_all(f"the engine stopped: {exc}")
                self._notify(self.on_fatal, self.fatal)
                return
            except Exception as exc:  # an engine bug must not kill the loop (nor the server)
                logger.exception("engine loop error; failing the requests in the engine")
                self._fail_all(f"engine error: {exc!r}")
        self._fail_all("the server is shutting down")

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
            _, sub, items = cmd
            added: list[str] = []
            try:
                for request_id, prompt, params, opts in items:
                    self.engine.add_request(
                        prompt, params, request_id=request_id, stream=True, **opts
                    )
                    added.append(request_id)
            except Exception as exc:  # all or none: take back those already added
                for request_id in added:
                    self.engine.abort(request_id)
                if not isinstance(exc, ValueError):
                    logger.exception("adding a request failed")
                    exc = RequestFailed(f"the engine could not add this request: {exc!r}")
                sub.put(exc)
            else:
                sub.put(_ACCEPTED)
            self._publish_stats()
        elif kind == "abort":
            for request_id in cmd[1]:
                req = self.engine.requests.get(request_id)
                if req is None:
                    continue  # finished meanwhile, or never added
                self.engine.abort(request_id)
                self._notify(self.on_aborted, req.num_prompt_tokens, len(req.output_token_ids))
            self._publish_stats()

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:  # counted before its handler can answer
            self._notify(self.on_finished, out)
        entry = self._streams.get(out.request_id)
        if entry is not None:
            sub, k = entry
            sub.put((k, out))

    @staticmethod
    def _notify(callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is not None:
            try:
                callback(*args)
            except Exception:  # noqa: BLE001 (the metrics must not fail a request)
                logger.exception("a finished-request callback failed")

    def _fail_all(self, message: str) -> None:
        """Fail every request in the engine and every submission still waiting."""
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 (keep failing the others)
                logger.exception("aborting %s failed", request_id)
        for sub in {sub for sub, _ in list(self._streams.values())}:
            sub.put(RequestFailed(message))
        try:
            self._publish_stats()
        except Exception:  # noqa: BLE001
            logger.exception("publishing stats failed")

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
            # speculative decoding (None when off): a copy, read on the server's thread
            "spec_decode": eng.spec_stats.copy() if eng.speculative_config else None,
        }

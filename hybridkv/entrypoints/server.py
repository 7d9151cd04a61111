"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (both with server-sent-event
streaming ending in `data: [DONE]`), /health and /metrics (Prometheus text format).

Concurrent clients are batched together by the engine's background loop. A client that
disconnects has its request aborted and its pages returned to the pool. Bad input is answered
with a 4xx and an OpenAI-style error body; nothing about it reaches the engine.

Chat prompts use the tokenizer's `chat_template` (tokenizer_config.json) when there is one,
else DEFAULT_CHAT_TEMPLATE: every message as "<|role|>\\n{content}\\n", then "<|assistant|>\\n".

A model without tokenizer.json (token-id mode) takes completion prompts as token ids only;
text prompts, stop strings and chat completions get a 400. Its choices and stream chunks carry
the generated `token_ids` (an extension) next to an empty `text`; log-prob tokens are written
"token_id:<id>".
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from hybridkv.engine import Engine
from hybridkv.entrypoints.async_engine import AsyncEngine
from hybridkv.entrypoints.metrics import Metrics
from hybridkv.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    message_text,
)
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Server:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.async_engine = AsyncEngine(engine)
        self.metrics = Metrics(self.async_engine)
        self.created = int(time.time())
        self._template = None

    # -- validation --------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self, body, prompt_len: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        if body.n != 1:
            raise OpenAIError(f"n must be 1 (got {body.n})", param="n")
        room = self.engine.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {prompt_len} and max_tokens is {max_tokens}, so at most "
                f"{room} new tokens fit",
                param="max_tokens",
            )
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "seed": body.seed,
            "ignore_eos": body.ignore_eos,
            "min_tokens": body.min_tokens,
            "logprobs": logprobs,
        }
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
        if body.stop is not None:
            kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
            if kwargs["stop"] and self.engine.tokenizer is None:
                raise OpenAIError(
                    "this model has no tokenizer, so stop strings cannot be matched: "
                    "use stop_token_ids instead",
                    param="stop",
                )
        if body.stop_token_ids:
            kwargs["stop_token_ids"] = body.stop_token_ids
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise OpenAIError(
                "this model has no tokenizer, so it takes token-id prompts only: give prompt "
                "as a list of token ids or a list of such lists",
                param=param,
            )
        try:
            ids, _ = self.engine._prompt_ids(prompt)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param) from None
        return ids

    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        import jinja2.sandbox

        if self.engine.tokenizer is None:
            raise OpenAIError(
                "this model has no tokenizer, so chat completions (which need one for the chat "
                "template) are not available: use /v1/completions with token-id prompts",
                param="messages",
            )
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=False)
            source = self.engine.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
            self._template = env.from_string(source)
        messages = [{"role": m.role, "content": message_text(m)} for m in body.messages]
        cfg = self.engine.tokenizer.config
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=_token_text(cfg.get("bos_token")),
                eos_token=_token_text(cfg.get("eos_token")),
            )
        except Exception as exc:  # a template error is the request's fault (its messages)
            raise OpenAIError(f"cannot apply the chat template: {exc}", param="messages") from None


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return str(token or "")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Delta:
    """New text since the last chunk; holds back an incomplete multi-byte character."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, out: RequestOutput) -> str:
        text = out.text
        end = len(text) if out.finished else len(text.rstrip("\ufffd"))
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


# ---------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------


def _token_str(tok, token_id: int) -> str:
    """One token as text; "token_id:<id>" without a tokenizer (as vLLM writes them)."""
    if tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(server: Server, out: RequestOutput) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    tok = server.engine.tokenizer
    tokens = [_token_str(tok, t) for t in out.token_ids]
    chosen = [entry.get(t) for t, entry in zip(out.token_ids, out.logprobs, strict=False)]
    tops = [{_token_str(tok, k): v for k, v in entry.items()} for entry in out.logprobs]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t) if tok is not None else 0  # offsets into the (empty) text
    return {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError("prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


async def completions(server: Server, body: CompletionRequest):
    server.check_model(body.model)
    prompts = _completion_prompts(body)
    ids = [server.prompt_ids(p) for p in prompts]
    params = [server.sampling_params(body, len(i), body.max_tokens, body.logprobs) for i in ids]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    tok = server.engine.tokenizer
    echo = [p if isinstance(p, str) else tok.decode(p) if tok is not None else "" for p in prompts]
    if body.stream:
        gens = [server.async_engine.generate(i, sp) for i, sp in zip(ids, params, strict=True)]
        return _stream(_completion_chunks(server, body, gens, rid, created, ids, echo))
    outs = [
        await _last(server.async_engine.generate(i, sp)) for i, sp in zip(ids, params, strict=True)
    ]
    choices = [
        {
            "index": k,
            "text": (echo[k] if body.echo else "") + o.text,
            "logprobs": _completion_logprobs(server, o),
            "finish_reason": o.finish_reason,
            "stop_reason": o.outputs[0].stop_reason,
        }
        for k, o in enumerate(outs)
    ]
    if tok is None:  # token-id mode: the text is empty, so say which tokens came out
        for choice, i, o in zip(choices, ids, outs, strict=True):
            choice["prompt_token_ids"], choice["token_ids"] = i, o.token_ids
    done = sum(len(o.token_ids) for o in outs)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage(sum(len(i) for i in ids), done),
    }


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams as (index, output) in arrival order."""
    import asyncio

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((k, out))
        except BaseException as exc:  # noqa: BLE001 (forwarded to the consumer)
            await queue.put((k, exc))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
    try:
        open_streams = len(gens)
        while open_streams:
            k, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await g.aclose()


async def _completion_chunks(server, body, gens, rid, created, ids, echo) -> AsyncIterator[str]:
    def chunk(k: int, text: str, finish: str | None, **extra: list[int]) -> str:
        choice = {"index": k, "text": text, "logprobs": None, "finish_reason": finish}
        return _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [{**choice, **extra}],
            }
        )

    token_ids = server.engine.tokenizer is None  # token-id mode: chunks carry new token ids
    deltas = [_Delta() for _ in gens]
    sent = [0] * len(gens)
    completion_tokens = 0
    if body.echo:
        for k, text in enumerate(echo):
            yield chunk(k, text, None, **({"prompt_token_ids": ids[k]} if token_ids else {}))
    async for k, out in _merge(gens):
        text = deltas[k](out)
        if out.finished:
            completion_tokens += len(out.token_ids)
        finish = out.finish_reason if out.finished else None
        if token_ids:
            new, sent[k] = out.token_ids[sent[k] :], len(out.token_ids)
            if new or out.finished:
                yield chunk(k, text, finish, token_ids=new)
        elif text or out.finished:
            yield chunk(k, text, finish)
    if (body.stream_options or {}).get("include_usage"):
        yield _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [],
                "usage": _usage(sum(len(i) for i in ids), completion_tokens),
            }
        )
    yield _sse("[DONE]")


# ---------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------


def _chat_logprobs(server: Server, out: RequestOutput) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    tok = server.engine.tokenizer
    content = []
    for t, entry in zip(out.token_ids, out.logprobs, strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        content.append(
            {
                "token": tok.decode([t], skip_special_tokens=False),
                "logprob": entry.get(t),
                "bytes": None,
                "top_logprobs": [
                    {
                        "token": tok.decode([k], skip_special_tokens=False),
                        "logprob": v,
                        "bytes": None,
                    }
                    for k, v in top
                ],
            }
        )
    return {"content": content}


async def chat_completions(server: Server, body: ChatCompletionRequest):
    server.check_model(body.model)
    ids = server.prompt_ids(server.chat_prompt(body), param="messages")
    top = body.top_logprobs if body.logprobs else None
    if body.logprobs and top is None:
        top = 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = server.sampling_params(body, len(ids), max_tokens, top)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    gen = server.async_engine.generate(ids, params, prefix="chat")
    if body.stream:
        return _stream(_chat_chunks(body, gen, rid, created, len(ids)))
    out = await _last(gen)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": _chat_logprobs(server, out),
        "finish_reason": out.finish_reason,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [choice],
        "usage": _usage(len(ids), len(out.token_ids)),
    }


async def _chat_chunks(body, gen, rid, created, prompt_tokens) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None) -> str:
        return _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
        )

    yield chunk({"role": "assistant", "content": ""}, None)
    delta, completion_tokens = _Delta(), 0
    try:
        async for out in gen:
            text = delta(out)
            if text:
                yield chunk({"content": text}, None)
            if out.finished:
                completion_tokens = len(out.token_ids)
                yield chunk({}, out.finish_reason)
    finally:
        await gen.aclose()
    if (body.stream_options or {}).get("include_usage"):
        yield _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [],
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )
    yield _sse("[DONE]")


def _stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


# ---------------------------------------------------------------------------------------------
# App
# ---------------------------------------------------------------------------------------------


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(OpenAIError(message, status, param).body(), status_code=status)


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.async_engine.shutdown()

    app = FastAPI(title="hybridkv", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        server.metrics.count_request(f"error_{exc.status}")
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        server.metrics.count_request("error_400")
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {first.get('msg', '')}")
        return _error(
            400, f"invalid value for '{where}': {first.get('msg', 'invalid')}", param=where or None
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "hybridkv",
                    "max_model_len": server.engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionRequest):
        return await completions(server, body)

    @app.post("/v1/chat/completions")
    async def v1_chat(body: ChatCompletionRequest):
        return await chat_completions(server, body)

    return app


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    app = build_app(Server(engine, model_name))
    uvicorn.run(app, host=host, port=port, log_level="info")

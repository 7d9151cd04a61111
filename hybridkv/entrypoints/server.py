"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (both with server-sent-event
streaming ending in `data: [DONE]`), /health and /metrics (Prometheus text format).

Concurrent clients are batched together by the engine's background loop; the prompts of one
request enter the engine together. A client that disconnects (streaming or not) has its
requests aborted and their pages returned to the pool.

Errors, whatever their cause (bad input, unknown route, wrong method, a body over
`max_request_bytes`, a request the engine gave up on, a bug), are answered in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` with a 4xx or 5xx status; `param` names the
field to blame ("max_tokens", "messages.0.content"). A stream that fails after it started sends
`data: {"error": {...}}` and then `data: [DONE]`. Bad input never reaches the engine, and one
request's failure never touches another's.

The event loop only moves bytes: a body over INLINE_PARSE_BYTES is parsed, every prompt is
tokenized and every chat template rendered in worker threads, and the body's size is checked
(Content-Length, then while it streams in) before it is read.

Chat prompts use the tokenizer's `chat_template` (tokenizer_config.json) when there is one,
else DEFAULT_CHAT_TEMPLATE: every message as "<|role|>\\n{content}\\n", then "<|assistant|>\\n".

A model without tokenizer.json (token-id mode) takes completion prompts as token ids only;
text prompts, stop strings and chat completions get a 400. Its choices and stream chunks carry
the generated `token_ids` (an extension) next to an empty `text`; log-prob tokens are written
"token_id:<id>".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybridkv.engine import Engine
from hybridkv.entrypoints.async_engine import AsyncEngine, RequestFailed, Submission
from hybridkv.entrypoints.metrics import Metrics
from hybridkv.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    message_text,
)
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams, check_unicode

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
INLINE_PARSE_BYTES = 64 * 2**10  # bodies up to this size are parsed on the event loop
CLIENT_GONE = 499  # the status logged for a request whose client left (nobody receives it)

Body = TypeVar("Body", bound=BaseModel)


class Server:
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.engine = engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.async_engine = AsyncEngine(engine)
        self.metrics = Metrics(self.async_engine)
        self.created = int(time.time())
        self._template = None

    # -- reading a request ---------------------------------------------------------------------

    async def read_body(self, request: Request, model: type[Body]) -> Body:
        """The body parsed into `model`; its size is checked before it is read (the
        Content-Length header) and while it streams in (chunked bodies)."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise OpenAIError(f"invalid Content-Length header: {declared!r}")
            if int(declared) > limit:
                raise _too_large(int(declared), limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise OpenAIError("the client disconnected", status=CLIENT_GONE) from None
        raw = b"".join(chunks)
        if len(raw) <= INLINE_PARSE_BYTES:
            return _parse_body(raw, model)
        return await asyncio.to_thread(_parse_body, raw, model)

    # -- validation (prompt_ids and chat_ids run in worker threads) ------------------------------

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self,
        body,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        names: dict[str, str] | None = None,
    ) -> SamplingParams:
        """`names` maps a SamplingParams field to the request field it came from when they
        differ (chat's "max_completion_tokens", "top_logprobs"), for the error's `param`."""
        names = names or {}
        if body.n != 1:
            raise OpenAIError(f"n must be 1 (got {body.n})", param="n")
        room = self.engine.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            name = names.get("max_tokens", "max_tokens")
            raise OpenAIError(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {prompt_len} and {name} is {max_tokens}, so at most "
                f"{room} new tokens fit",
                param=name,
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
            # SamplingParams' messages start with the field at fault ("seed must be ...")
            message = str(exc)
            lead = re.match(r"\w+", message)
            field = lead.group(0) if lead and lead.group(0) in kwargs else None
            if field in names:
                message = names[field] + message[len(field) :]  # type: ignore[index]
            raise OpenAIError(message, param=names.get(field, field)) from None

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise OpenAIError(
                "this model has no tokenizer, so it takes token-id prompts only: give prompt "
                "as a list of token ids or a list of such lists",
                param=param,
            )
        try:  # reads only what the engine never changes: its tokenizer and limits
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
        messages = []
        for k, m in enumerate(body.messages):
            text = message_text(m, k)
            try:
                check_unicode(text, "message content")
            except ValueError as exc:
                raise OpenAIError(str(exc), param=f"messages.{k}.content") from None
            messages.append({"role": m.role, "content": text})
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

    # -- running -------------------------------------------------------------------------------

    async def submit(
        self, ids: list[list[int]], params: list[SamplingParams], prefix: str, param: str
    ) -> Submission:
        try:
            return await self.async_engine.submit(ids, params, prefix)
        except ValueError as exc:  # the engine's own checks (the server's came first)
            raise OpenAIError(str(exc), param=param) from None
        except RequestFailed as exc:
            raise OpenAIError(str(exc), status=503) from None

    async def results(self, request: Request, sub: Submission) -> list[RequestOutput] | None:
        """The final outputs; None if the client left first (its requests are aborted)."""
        results = asyncio.ensure_future(sub.results())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():
                return None
            try:
                return results.result()
            except RequestFailed as exc:  # 503 when the whole engine stopped
                status = 503 if self.async_engine.fatal else 500
                raise OpenAIError(str(exc), status=status) from None
        finally:
            results.cancel()
            gone.cancel()
            sub.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already: uvicorn's
    receive() then waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # a server that answers at once (more empty body): poll


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        f"the request body is larger than {limit} bytes, the most this server takes "
        f"(--max-request-bytes; got {size} bytes or more)",
        status=413,
        code="request_too_large",
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_body(raw: bytes, model: type[Body]) -> Body:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(f"the request body is not valid UTF-8 (at byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise OpenAIError("malformed JSON body: it is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer of 4300+ digits
        raise OpenAIError(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(f"the request body must be a JSON object, not {_json_type(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors(include_url=False), data) from None
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply") from None


def _json_type(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    names |= {list: "an array", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _validation_error(errors: Sequence[Any], data: Any) -> OpenAIError:
    first = errors[0] if errors else {}
    where = _param_path(first.get("loc", ()), data, first.get("type") == "missing")
    if first.get("type") == "missing":
        message = f"'{where}' is required"
    else:
        message = f"invalid value for '{where}': {first.get('msg', 'invalid')}"
    return OpenAIError(message, param=where or None)


def _param_path(loc: Sequence[Any], data: Any, missing: bool) -> str:
    """A pydantic error location as a path into the body ("messages.0.content"): the parts
    that index into the submitted JSON, without pydantic's union tags ("str", "list[int]")."""
    parts, node = [], data
    for i, key in enumerate(loc):
        in_dict = isinstance(node, dict) and isinstance(key, str) and key in node
        in_list = isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)
        if in_dict or in_list:
            node = node[key]
        elif isinstance(key, str) and not isinstance(node, dict):
            continue  # the tag of a union's member ("str", "ids")
        elif not (missing and i == len(loc) - 1):
            break
        parts.append(str(key))
    return ".".join(parts)


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


def _finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's finish reasons only ("abort" raised RequestFailed before this)."""
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def _finite(logprob: float | None) -> float | None:
    """JSON has no -Infinity: an impossible token gets a very low log-prob (as vLLM does)."""
    if logprob is None or math.isfinite(logprob):
        return logprob
    return -9999.0 if logprob < 0 else 0.0


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


def _completion_logprobs(
    tok, token_ids: list[int], entries: list[dict[int, float]], offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The completions `logprobs` object of these tokens, their text offsets counted from
    `offset`; and the offset after them."""
    tokens = [_token_str(tok, t) for t in token_ids]
    chosen = [_finite(entry.get(t)) for t, entry in zip(token_ids, entries, strict=False)]
    tops = [{_token_str(tok, k): _finite(v) for k, v in entry.items()} for entry in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t) if tok is not None else 0  # offsets into the (empty) text
    logprobs = {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return logprobs, offset


def _completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError("prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def _prepare_completion(
    server: Server, body: CompletionRequest
) -> tuple[list[list[int]], list[SamplingParams], list[str]]:
    """Token ids, sampling params and echo text of every prompt (in a worker thread)."""
    prompts = _completion_prompts(body)
    ids = [server.prompt_ids(p) for p in prompts]
    params = [server.sampling_params(body, len(i), body.max_tokens, body.logprobs) for i in ids]
    tok = server.engine.tokenizer
    echo = []
    if body.echo:
        for p in prompts:
            echo.append(p if isinstance(p, str) else tok.decode(p) if tok is not None else "")
    return ids, params, echo


async def completions(server: Server, request: Request):
    body = await server.read_body(request, CompletionRequest)
    server.check_model(body.model)
    ids, params, echo = await asyncio.to_thread(_prepare_completion, server, body)
    sub = await server.submit(ids, params, "cmpl", param="prompt")
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _stream(_completion_chunks(server, body, sub, rid, created, ids, echo))
    outs = await server.results(request, sub)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    tok = server.engine.tokenizer
    choices = [
        {
            "index": k,
            "text": (echo[k] if body.echo else "") + o.text,
            "logprobs": (
                _completion_logprobs(tok, o.token_ids, o.logprobs)[0]
                if o.logprobs is not None
                else None
            ),
            "finish_reason": _finish_reason(o),
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


async def _completion_chunks(
    server: Server, body: CompletionRequest, sub: Submission, rid, created, ids, echo
) -> AsyncIterator[str]:
    def chunk(k: int, text: str, finish: str | None, logprobs=None, **extra: list[int]) -> str:
        choice = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [{**choice, **extra}],
            }
        )

    tok = server.engine.tokenizer
    token_ids = tok is None  # token-id mode: chunks carry new token ids
    n = len(ids)
    deltas = [_Delta() for _ in range(n)]
    sent, offsets = [0] * n, [0] * n  # tokens (and their text) sent per prompt
    completion_tokens = 0
    try:
        if body.echo:
            for k, text in enumerate(echo):
                yield chunk(k, text, None, **({"prompt_token_ids": ids[k]} if token_ids else {}))
        async for k, out in sub.outputs():
            text = deltas[k](out)
            if out.finished:
                completion_tokens += len(out.token_ids)
            new = out.token_ids[sent[k] :]
            if not (text or out.finished or (token_ids and new)):
                continue  # nothing to show yet (held back): its tokens go with the next chunk
            logprobs = None
            if out.logprobs is not None:
                entries = out.logprobs[sent[k] :]
                logprobs, offsets[k] = _completion_logprobs(tok, new, entries, offsets[k])
            sent[k] = len(out.token_ids)
            extra = {"token_ids": new} if token_ids else {}
            yield chunk(k, text, _finish_reason(out), logprobs, **extra)
    finally:
        sub.close()
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


def _chat_logprob_content(
    tok, token_ids: list[int], entries: list[dict[int, float]]
) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float | None) -> dict[str, Any]:
        text = tok.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = []
    for t, entry in zip(token_ids, entries, strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        content.append({**one(t, entry.get(t)), "top_logprobs": [one(k, v) for k, v in top]})
    return content


def _prepare_chat(server: Server, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """The rendered and tokenized prompt and the sampling params (in a worker thread)."""
    ids = server.prompt_ids(server.chat_prompt(body), param="messages")
    top = body.top_logprobs if body.logprobs else None
    if body.logprobs and top is None:
        top = 0
    names = {"logprobs": "top_logprobs"}
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    return ids, server.sampling_params(body, len(ids), max_tokens, top, names)


async def chat_completions(server: Server, request: Request):
    body = await server.read_body(request, ChatCompletionRequest)
    server.check_model(body.model)
    ids, params = await asyncio.to_thread(_prepare_chat, server, body)
    sub = await server.submit([ids], [params], "chat", param="messages")
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _stream(_chat_chunks(server, body, sub, rid, created, len(ids)))
    outs = await server.results(request, sub)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    (out,) = outs
    tok = server.engine.tokenizer
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": (
            {"content": _chat_logprob_content(tok, out.token_ids, out.logprobs)}
            if out.logprobs is not None
            else None
        ),
        "finish_reason": _finish_reason(out),
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [choice],
        "usage": _usage(len(ids), len(out.token_ids)),
    }


async def _chat_chunks(
    server: Server, body: ChatCompletionRequest, sub: Submission, rid, created, prompt_tokens
) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None, logprobs=None) -> str:
        return _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    tok = server.engine.tokenizer
    delta, sent, completion_tokens = _Delta(), 0, 0
    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        async for _, out in sub.outputs():
            text = delta(out)
            if not (text or out.finished):
                continue  # held back: its tokens' log-probs go with the next chunk
            logprobs = None
            if out.logprobs is not None:
                new = out.token_ids[sent:]
                logprobs = {"content": _chat_logprob_content(tok, new, out.logprobs[sent:])}
                sent = len(out.token_ids)
            if text:
                yield chunk({"content": text}, None, logprobs)
                logprobs = None
            if out.finished:
                completion_tokens = len(out.token_ids)
                yield chunk({}, _finish_reason(out), logprobs)
    finally:
        sub.close()
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


# ---------------------------------------------------------------------------------------------
# Streaming responses
# ---------------------------------------------------------------------------------------------


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that fails after it started ends with an error event and [DONE]."""
    try:
        async for c in chunks:
            yield c
    except RequestFailed as exc:
        yield _sse(OpenAIError(str(exc), status=500).body())
        yield _sse("[DONE]")
    except Exception as exc:
        logger.exception("a stream failed")
        yield _sse(OpenAIError(f"internal server error: {exc!r}", status=500).body())
        yield _sse("[DONE]")
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


class _EventStream(StreamingResponse):
    """A streaming response whose body iterator is always closed, also when the client left
    while the iterator was suspended (closing it aborts the requests it streams)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return _EventStream(
        _guarded(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


# ---------------------------------------------------------------------------------------------
# App
# ---------------------------------------------------------------------------------------------


def _error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = OpenAIError(message, status, param, code).body()
    return JSONResponse(body, status_code=status, headers=headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.async_engine.shutdown()

    app = FastAPI(title="hybridkv", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        server.metrics.count_request(f"error_{exc.status}")
        if exc.status == CLIENT_GONE:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        server.metrics.count_request("error_400")
        err = _validation_error_of(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        server.metrics.count_request(f"error_{status}")
        where = f"{request.method} {request.url.path}"
        if status == 404:
            message = f"there is no route {where}"
        elif status == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}" + (
                f" (allowed: {allowed})" if allowed else ""
            )
        else:
            message = f"{where}: {exc.detail}"
        return _error(status, message, code=_HTTP_CODES.get(status), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error: %r", exc)
        server.metrics.count_request("error_500")
        return _error(500, f"internal server error: {exc!r}")

    @app.get("/health")
    async def health() -> Response:
        if not server.async_engine.alive:
            return _error(503, "the engine loop is not running")
        return JSONResponse({"status": "ok"})

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
    async def v1_completions(request: Request):
        return await completions(server, request)

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request):
        return await chat_completions(server, request)

    return app


def _validation_error_of(exc: RequestValidationError) -> OpenAIError:
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return OpenAIError(f"malformed JSON body: {first.get('msg', '')}")
    loc = tuple(p for p in first.get("loc", ()) if p != "body")
    where = ".".join(str(p) for p in loc)
    return OpenAIError(f"invalid value for '{where}': {first.get('msg')}", param=where or None)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (before a model loads: a busy port is found at once).
    OSError (address in use, unknown host) is the caller's to report."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    sock: socket.socket | None = None,
) -> str | None:
    """Serve until interrupted; on `sock` (from bind_socket) if given, else on host:port.
    Returns None, or the error that stopped the engine (a tensor-parallel rank died or hung):
    requests then get 503 and the server shuts down, for the caller to exit non-zero."""
    import uvicorn

    state = Server(engine, model_name, max_request_bytes)
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    http = uvicorn.Server(config)

    def stop(_: str) -> None:
        http.should_exit = True  # read by uvicorn's main loop; in-flight answers finish

    state.async_engine.on_fatal = stop
    http.run(sockets=[sock] if sock is not None else None)
    return state.async_engine.fatal

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
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybridkv.engine import Engine
from hybridkv.entrypoints.adapters import (
    anthropic_error,
    chat_stream_to_message_events,
    chat_stream_to_response_events,
    chat_to_message,
    chat_to_response,
    messages_to_chat,
    rename_chat_error,
    responses_to_chat,
)
from hybridkv.entrypoints.async_engine import AsyncEngine, RequestFailed, Submission
from hybridkv.entrypoints.chat import ChatOutput
from hybridkv.entrypoints.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    normalise_messages,
    template_variables,
)
from hybridkv.entrypoints.metrics import Metrics
from hybridkv.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    message_text,
    refuse_message_extras,
)
from hybridkv.entrypoints.reasoning import get_reasoning_parser
from hybridkv.entrypoints.structured import check_tools, grammar_of, tool_grammar, tool_mode
from hybridkv.entrypoints.tool_parsers import default_tool_parser, get_tool_parser
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import (
    MAX_CHOICES,
    SamplingParams,
    check_unicode,
    choice_seed,
)

logger = logging.getLogger(__name__)

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
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """`tool_parser`: how this model writes tool calls ("hermes", "qwen3_coder"; None: read
        from its chat template). `reasoning_parser`: None (no reasoning split), "qwen3" or
        "deepseek_r1" (<think>...</think> -> reasoning_content)."""
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        tok = engine.tokenizer
        if tool_parser is None:
            tool_parser = default_tool_parser(tok.chat_template if tok is not None else None)
        get_tool_parser(tool_parser)  # a ValueError listing the valid names
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
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
        **more: Any,
    ) -> SamplingParams:
        """`names` maps a SamplingParams field to the request field it came from when they
        differ (chat's "max_completion_tokens", "top_logprobs"), for the error's `param`.
        `more`: SamplingParams fields the handler sets itself (seed, structured, ...)."""
        names = names or {}
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
            "include_stop_str_in_output": body.include_stop_str_in_output,
            "logit_bias": _logit_bias(body.logit_bias),
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):  # fmt: skip
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
        kwargs |= more
        try:
            params = SamplingParams(**kwargs)
            self.engine._check_logit_bias(params)
            return params
        except ValueError as exc:
            # SamplingParams' messages start with the field at fault ("seed must be ...")
            message = str(exc)
            lead = re.match(r"\w+", message)
            field = lead.group(0) if lead and lead.group(0) in kwargs else None
            if field in names:
                message = names[field] + message[len(field) :]  # type: ignore[index]
            raise OpenAIError(message, param=names.get(field, field)) from None

    def grammar(self, spec: Any, param: str) -> Any:
        """Compile a grammar now (worker thread; cached) so that a bad one is a 400 here."""
        if spec is None:
            return None
        try:
            self.engine.grammars.compile(spec)
        except ValueError as exc:
            raise OpenAIError(f"invalid {param}: {exc}", param=param) from None
        return spec

    def prompt_ids(
        self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """A prompt's token ids (`add_special_tokens=False`: a rendered chat prompt)."""
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise OpenAIError(
                "this model has no tokenizer, so it takes token-id prompts only: give prompt "
                "as a list of token ids or a list of such lists",
                param=param,
            )
        try:  # reads only what the engine never changes: its tokenizer and limits
            ids, _ = self.engine._prompt_ids(prompt, add_special_tokens)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param) from None
        return ids

    def chat_prompt(self, body: ChatCompletionRequest, tools: list[dict] | None = None) -> str:
        if self.engine.tokenizer is None:
            raise OpenAIError(
                "this model has no tokenizer, so chat completions (which need one for the chat "
                "template) are not available: use /v1/completions with token-id prompts",
                param="messages",
            )
        template = self.template
        if body.chat_template is not None:
            try:
                template = ChatTemplate(body.chat_template)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="chat_template") from None
        messages = [self._chat_message(m, k) for k, m in enumerate(body.messages)]
        try:
            variables = template_variables(self.engine.tokenizer.config, body.chat_template_kwargs)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="chat_template_kwargs") from None
        try:
            return template.render(
                normalise_messages(messages),
                tools=tools,
                add_generation_prompt=body.add_generation_prompt,
                **variables,
            )
        except ValueError as exc:  # a template error is the request's fault (its messages)
            raise OpenAIError(f"cannot apply the chat template: {exc}", param="messages") from None

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            assert self.engine.tokenizer is not None
            source = self.engine.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
            self._template = ChatTemplate(source)
        return self._template

    @staticmethod
    def _chat_message(m: ChatMessage, k: int) -> dict[str, Any]:
        refuse_message_extras(m, k)
        text = message_text(m, k)
        try:
            check_unicode(text, "message content")
        except ValueError as exc:
            raise OpenAIError(str(exc), param=f"messages.{k}.content") from None
        message: dict[str, Any] = {"role": m.role, "content": text}
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, name) is not None:
                message[name] = getattr(m, name)
        return message

    # -- running -------------------------------------------------------------------------------

    async def submit(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        prefix: str,
        param: str,
        options: list[dict[str, Any]] | None = None,
    ) -> Submission:
        try:
            return await self.async_engine.submit(ids, params, prefix, options)
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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise OpenAIError(f"logit_bias keys must be token ids, got {key!r}",
                              param="logit_bias")  # fmt: skip
        out[int(key)] = value
    return out


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


def _token_str(tok, token_id: int, as_ids: bool = False) -> str:
    """One token as text; "token_id:<id>" without a tokenizer or when asked
    (return_tokens_as_token_ids), as vLLM writes them."""
    if tok is None or as_ids:
        return f"token_id:{token_id}"
    return tok.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(
    tok,
    token_ids: list[int],
    entries: Sequence[dict[int, float] | None],
    offset: int = 0,
    as_ids: bool = False,
) -> tuple[dict[str, Any], int]:
    """The completions `logprobs` object of these tokens, their text offsets counted from
    `offset`; and the offset after them. An entry None (a prompt's first token) has neither a
    log-prob nor top log-probs (null, as OpenAI)."""
    texts = [_token_str(tok, t) for t in token_ids]  # decoded once: names and offsets
    tokens = [_token_str(tok, t, True) for t in token_ids] if as_ids else texts
    chosen, tops = [], []
    for t, entry in zip(token_ids, entries, strict=False):
        chosen.append(None if entry is None else _finite(entry.get(t)))
        tops.append(
            None
            if entry is None
            else {_token_str(tok, k, as_ids): _finite(v) for k, v in entry.items()}
        )
    offsets = []
    for text in texts:
        offsets.append(offset)
        # offsets into the text (empty in token-id mode)
        offset += len(text) if tok is not None else 0
    logprobs = {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return logprobs, offset


def _vllm_prompt_logprobs(
    tok, ids: list[int], entries: Sequence[dict[int, float] | None] | None, top: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt token and the `top` most likely ones (rank 1-based;
    null for a prompt token outside the top)."""
    out: list[dict[str, Any] | None] = []
    for t, entry in zip(ids, entries or [None] * len(ids), strict=False):
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry, key=lambda k: -entry[k])
        item: dict[str, Any] = {}
        for rank, k in enumerate(ranked, 1):
            if rank <= top or k == t:
                item[str(k)] = {
                    "logprob": _finite(entry[k]),
                    "rank": rank if rank <= top or len(ranked) <= top else None,
                    "decoded_token": _token_str(tok, k) if tok is not None else "",
                }
        out.append(item)
    return out


def _completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError("prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]




def _choice_counts(n: int, best_of: int | None, stream: bool) -> tuple[int, int]:
    """(n, best_of): best_of sequences are generated and the n most likely returned."""
    if not 1 <= n <= MAX_CHOICES:
        raise OpenAIError(f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    best = n if best_of is None else best_of
    if not n <= best <= MAX_CHOICES:
        raise OpenAIError(f"best_of must be in [n, {MAX_CHOICES}] (n is {n}), got {best}",
                          param="best_of")  # fmt: skip
    if stream and best > n:
        raise OpenAIError("best_of > n cannot be streamed", param="best_of")
    return n, best


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    if keep is None:
        return ids
    if keep < 1:
        raise OpenAIError(f"truncate_prompt_tokens must be >= 1, got {keep}",
                          param="truncate_prompt_tokens")  # fmt: skip
    return ids[-keep:]


def _cache_options(body, after: int | None) -> dict[str, Any]:
    salt = () if body.cache_salt is None else (("cache_salt", body.cache_salt),)
    return {"after": after, "extra_keys": salt}


@dataclass
class _CompletionPlan:
    """Every engine request of one completion request: `best_of` per prompt, the first of
    each prompt prefills and the others wait for it (`after`) and hit its prompt."""

    ids: list[list[int]]  # per prompt
    echo: list[str]  # per prompt: the prompt's text (echo)
    n: int
    best_of: int
    echo_only: bool  # max_tokens 0 with echo: score the prompt, generate nothing
    params: list[SamplingParams] = field(default_factory=list)  # per engine request
    options: list[dict[str, Any]] = field(default_factory=list)

    @property
    def requests(self) -> list[list[int]]:
        return [i for i in self.ids for _ in range(self.best_of)]


def _prepare_completion(server: Server, body: CompletionRequest) -> _CompletionPlan:
    """Token ids, sampling params and echo text of every request (in a worker thread)."""
    body.refuse_unsupported()
    prompts = _completion_prompts(body)
    n, best_of = _choice_counts(body.n, body.best_of, body.stream)
    spec = server.grammar(grammar_of(body), "structured output")
    ids = [_truncate(server.prompt_ids(p), body.truncate_prompt_tokens) for p in prompts]
    echo_only = body.echo and body.max_tokens == 0
    tok = server.engine.tokenizer
    echo = []
    if body.echo:
        for p in prompts:
            echo.append(p if isinstance(p, str) else tok.decode(p) if tok is not None else "")
    plan = _CompletionPlan(ids, echo, n, best_of, echo_only)
    echo_lp = body.logprobs if body.echo else None
    scored = [x for x in (body.prompt_logprobs, echo_lp) if x is not None]
    logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
    for i in ids:
        first = len(plan.params)
        for c in range(best_of):
            more: dict[str, Any] = {"seed": choice_seed(body.seed, c), "structured": spec}
            if c == 0 and scored:
                more["prompt_logprobs"] = max(scored)
            max_tokens = 1 if echo_only else body.max_tokens
            plan.params.append(server.sampling_params(body, len(i), max_tokens, logprobs, **more))
            plan.options.append(_cache_options(body, first if c else None))
    return plan


def _pick_best(plan: _CompletionPlan, outs: list[RequestOutput]) -> list[tuple[int, RequestOutput]]:
    """(prompt index, output) of every returned choice, in choice-index order: per prompt the
    n of its best_of outputs with the highest cumulative log-prob."""
    picked = []
    for p in range(len(plan.ids)):
        group = outs[p * plan.best_of : (p + 1) * plan.best_of]
        if plan.best_of > plan.n:
            key = lambda o: o.outputs[0].cumulative_logprob or -math.inf  # noqa: E731
            group = sorted(group, key=key, reverse=True)[: plan.n]
        picked += [(p, o) for o in group]
    return picked


def _completion_choice(
    server: Server, body: CompletionRequest, plan: _CompletionPlan, k: int, p: int,
    out: RequestOutput, first: RequestOutput,
) -> dict[str, Any]:  # fmt: skip
    """Choice number k (of prompt p); `first` is the prompt's first request (it has the
    prompt's log-probs)."""
    tok = server.engine.tokenizer
    gen_ids = [] if plan.echo_only else out.token_ids
    text = "" if plan.echo_only else out.text
    choice: dict[str, Any] = {
        "index": k,
        "text": (plan.echo[p] if body.echo else "") + text,
        "logprobs": None,
        "finish_reason": "length" if plan.echo_only else _finish_reason(out),
        "stop_reason": None if plan.echo_only else out.outputs[0].stop_reason,
    }
    if body.logprobs is not None:
        choice["logprobs"] = _choice_logprobs(server, body, plan.ids[p], first, gen_ids, out)
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(
            tok, plan.ids[p], first.prompt_logprobs, body.prompt_logprobs
        )
    if tok is None or body.return_token_ids:  # token-id mode: the text is empty
        choice["prompt_token_ids"], choice["token_ids"] = plan.ids[p], gen_ids
    return choice


def _choice_logprobs(server, body, prompt_ids, first, gen_ids, out, offset: int = 0):
    tok, as_ids = server.engine.tokenizer, body.return_tokens_as_token_ids
    ids, entries = list(gen_ids), list(out.logprobs or [])[: len(gen_ids)]
    if body.echo:
        ids, entries = prompt_ids + ids, list(first.prompt_logprobs or []) + entries
    return _completion_logprobs(tok, ids, entries, offset, as_ids)[0]


def _usage_of(plan_prompts: list[list[int]], firsts: list[RequestOutput], generated: int):
    usage = _usage(sum(len(i) for i in plan_prompts), generated)
    usage["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}
    return usage


async def completions(server: Server, request: Request):
    body = await server.read_body(request, CompletionRequest)
    server.check_model(body.model)
    plan = await asyncio.to_thread(_prepare_completion, server, body)
    sub = await server.submit(plan.requests, plan.params, "cmpl", "prompt", plan.options)
    rid, created = f"cmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _stream(_completion_chunks(server, body, sub, rid, created, plan))
    outs = await server.results(request, sub)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    firsts = outs[:: plan.best_of]
    choices = [
        _completion_choice(server, body, plan, k, p, o, firsts[p])
        for k, (p, o) in enumerate(_pick_best(plan, outs))
    ]
    generated = 0 if plan.echo_only else sum(len(o.token_ids) for o in outs)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage_of(plan.ids, firsts, generated),
    }


async def _completion_chunks(
    server: Server, body: CompletionRequest, sub: Submission, rid, created, plan: _CompletionPlan
) -> AsyncIterator[str]:
    def chunk(k: int, text: str, finish: str | None, logprobs=None, **extra: Any) -> str:
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
    token_ids = tok is None or body.return_token_ids  # chunks carry new token ids
    n = len(plan.requests)
    deltas = [_Delta() for _ in range(n)]
    sent, offsets = [0] * n, [0] * n  # tokens (and their text) sent per request
    started = [False] * n
    firsts: dict[int, RequestOutput] = {}
    completion_tokens = 0
    try:
        async for k, out in sub.outputs():
            p = k // plan.best_of
            if k % plan.best_of == 0:
                firsts[p] = out
            if not started[k]:  # the echo goes first, with the prompt's log-probs
                started[k] = True
                if body.echo:
                    # the prompt's log-probs come from its first request (the others are held
                    # behind it, so its first output came before theirs)
                    first = firsts.get(p, out)
                    yield _echo_chunk(chunk, server, body, plan, k, p, first, offsets)
            if plan.echo_only:
                if out.finished:
                    yield chunk(k, "", "length")
                continue
            text = deltas[k](out)
            if out.finished:
                completion_tokens += len(out.token_ids)
            new = out.token_ids[sent[k] :]
            if not (text or out.finished or (token_ids and new)):
                continue  # nothing to show yet (held back): its tokens go with the next chunk
            logprobs = None
            if out.logprobs is not None and body.logprobs is not None:
                entries = out.logprobs[sent[k] :]
                logprobs, offsets[k] = _completion_logprobs(
                    tok, new, entries, offsets[k], body.return_tokens_as_token_ids
                )
            sent[k] = len(out.token_ids)
            extra = {"token_ids": new} if token_ids else {}
            yield chunk(k, text, _finish_reason(out), logprobs, **extra)
    finally:
        sub.close()
    if (body.stream_options or {}).get("include_usage"):
        usage = _usage_of(plan.ids, [firsts[p] for p in sorted(firsts)], completion_tokens)
        yield _sse(_usage_chunk(rid, "text_completion", created, body.model, usage))
    yield _sse("[DONE]")


def _usage_chunk(rid: str, kind: str, created: int, model: str, usage: dict) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage}  # fmt: skip


def _echo_chunk(chunk, server, body, plan, k: int, p: int, out, offsets: list[int]) -> str:
    """The first chunk of choice k: its prompt's text (and log-probs, first token null)."""
    extra: dict[str, Any] = {}
    if server.engine.tokenizer is None or body.return_token_ids:
        extra["prompt_token_ids"] = plan.ids[p]
    if body.prompt_logprobs is not None:
        tok = server.engine.tokenizer
        extra["prompt_logprobs"] = _vllm_prompt_logprobs(
            tok, plan.ids[p], out.prompt_logprobs, body.prompt_logprobs
        )
    logprobs = None
    if body.logprobs is not None:
        entries = out.prompt_logprobs or [None] * len(plan.ids[p])
        logprobs, offsets[k] = _completion_logprobs(
            server.engine.tokenizer, plan.ids[p], entries, 0, body.return_tokens_as_token_ids
        )
    return chunk(k, plan.echo[p], None, logprobs, **extra)


# ---------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------


def _chat_logprob_content(
    tok, token_ids: list[int], entries: Sequence[dict[int, float]], top: int = 20
) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float | None) -> dict[str, Any]:
        text = tok.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = []
    for t, entry in zip(token_ids, entries, strict=False):
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**one(t, entry.get(t)), "top_logprobs": [one(k, v) for k, v in best]})
    return content


@dataclass
class _ChatPlan:
    ids: list[int]
    params: list[SamplingParams]  # one per choice
    options: list[dict[str, Any]]
    mode: str  # tool mode: none, auto, required, named
    function: str | None
    tools: list[dict[str, Any]] | None
    top: int  # top_logprobs


def _prepare_chat(server: Server, body: ChatCompletionRequest) -> _ChatPlan:
    """The rendered and tokenized prompt and the sampling params (in a worker thread)."""
    body.refuse_unsupported()
    n, _ = _choice_counts(body.n, None, body.stream)
    tools = check_tools(body.tools)
    mode, function = tool_mode(body.tool_choice, tools)
    forced = tool_grammar(mode, function, tools, body.parallel_tool_calls)
    spec = server.grammar(grammar_of(body, forced), "structured output")
    # the template writes the special tokens (as vLLM: no BOS added on top)
    prompt = server.chat_prompt(body, body.tools or None)
    ids = server.prompt_ids(prompt, param="messages", add_special_tokens=False)
    ids = _truncate(ids, body.truncate_prompt_tokens)
    top = body.top_logprobs if body.logprobs else None
    if body.logprobs and top is None:
        top = 0
    names = {"logprobs": "top_logprobs"}
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    params = [
        server.sampling_params(body, len(ids), max_tokens, top, names,
                               seed=choice_seed(body.seed, c), structured=spec)  # fmt: skip
        for c in range(n)
    ]
    options = [_cache_options(body, 0 if c else None) for c in range(n)]
    return _ChatPlan(ids, params, options, mode, function, body.tools, top or 0)


def _chat_output(server: Server, plan: _ChatPlan) -> ChatOutput:
    parser = None
    if plan.mode == "auto":
        parser = get_tool_parser(server.tool_parser)(plan.tools)
    reasoning = get_reasoning_parser(server.reasoning_parser)() if server.reasoning_parser else None
    return ChatOutput(plan.mode, parser, reasoning, plan.function)


async def chat_completions(server: Server, request: Request):
    body = await server.read_body(request, ChatCompletionRequest)
    result = await run_chat(server, request, body)
    if result is None:
        return Response(status_code=CLIENT_GONE)
    if isinstance(result, dict):
        return result
    return _stream(_sse_of(result))


async def _sse_of(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for c in chunks:
            yield _sse(c)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield _sse("[DONE]")


async def run_chat(
    server: Server, request: Request, body: ChatCompletionRequest
) -> dict[str, Any] | AsyncIterator[dict[str, Any]] | None:
    """A chat completion: the response, or (streaming) its chunk objects, or None when the
    client left. The /v1/responses and /v1/messages adapters run through here too."""
    server.check_model(body.model)
    plan = await asyncio.to_thread(_prepare_chat, server, body)
    prompts = [plan.ids] * len(plan.params)
    sub = await server.submit(prompts, plan.params, "chat", "messages", plan.options)
    rid, created = f"chatcmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _chat_chunks(server, body, sub, rid, created, plan)
    outs = await server.results(request, sub)
    if outs is None:
        return None
    tok = server.engine.tokenizer
    choices = []
    for k, out in enumerate(outs):
        message, finish = _chat_output(server, plan).message(out.text, _finish_reason(out))
        logprobs = None
        if out.logprobs is not None:
            content = _chat_logprob_content(tok, out.token_ids, out.logprobs, plan.top)
            logprobs = {"content": content}
        choice = {"index": k, "message": message, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": out.outputs[0].stop_reason}  # fmt: skip
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    response = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage_of([plan.ids], outs[:1], sum(len(o.token_ids) for o in outs)),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = plan.ids
    return response


async def _chat_chunks(
    server: Server, body: ChatCompletionRequest, sub: Submission, rid, created, plan: _ChatPlan
) -> AsyncIterator[dict[str, Any]]:
    def chunk(k: int, delta: dict[str, Any], finish: str | None, logprobs=None, **extra) -> dict:
        choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            "choices": [choice | extra],
        }

    tok = server.engine.tokenizer
    n = len(plan.params)
    deltas = [_Delta() for _ in range(n)]
    outputs = [_chat_output(server, plan) for _ in range(n)]
    sent, completion_tokens = [0] * n, 0
    firsts: list[RequestOutput] = []
    try:
        for k in range(n):
            yield chunk(k, {"role": "assistant", "content": ""}, None)
        async for k, out in sub.outputs():
            if k == 0 and not firsts:
                firsts.append(out)
            text = deltas[k](out)
            if not (text or out.finished):
                continue  # held back: its tokens' log-probs go with the next chunk
            logprobs = None
            if out.logprobs is not None:
                new = out.token_ids[sent[k] :]
                content = _chat_logprob_content(tok, new, out.logprobs[sent[k] :], plan.top)
                logprobs = {"content": content}
                sent[k] = len(out.token_ids)
            for delta in outputs[k].deltas(text) if text else []:
                yield chunk(k, delta, None, logprobs)
                logprobs = None
            if out.finished:
                completion_tokens += len(out.token_ids)
                held, finish = outputs[k].finish(_finish_reason(out))
                for delta in held:
                    yield chunk(k, delta, None, logprobs)
                    logprobs = None
                yield chunk(k, {}, finish, logprobs, stop_reason=out.outputs[0].stop_reason)
    finally:
        sub.close()
    if (body.stream_options or {}).get("include_usage"):
        usage = _usage_of([plan.ids], firsts, completion_tokens)
        yield _usage_chunk(rid, "chat.completion.chunk", created, body.model, usage)


# ---------------------------------------------------------------------------------------------
# Responses API and Anthropic Messages: adapters over the chat path
# ---------------------------------------------------------------------------------------------


class _RawBody(BaseModel):
    """Any JSON object (the adapters check the fields themselves)."""

    model_config = {"extra": "allow"}


async def _adapted_chat(server: Server, request: Request, convert) -> tuple[dict, Any]:
    raw = (await server.read_body(request, _RawBody)).model_dump()
    chat = await asyncio.to_thread(convert, raw)
    api = "responses" if convert is responses_to_chat else "messages"
    try:  # errors of the chat path name the adapted request's fields
        try:
            body = ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise _validation_error(exc.errors(include_url=False), chat) from None
        return raw, await run_chat(server, request, body)
    except OpenAIError as exc:
        raise rename_chat_error(exc, chat, api) from None


async def _error_chunks(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks; a failure mid-stream becomes one {"error": ...} chunk (the adapters turn
    it into their own error event)."""
    try:
        async for c in chunks:
            yield c
    except RequestFailed as exc:
        yield OpenAIError(str(exc), status=500).body()
    except Exception as exc:
        logger.exception("a stream failed")
        yield OpenAIError(f"internal server error: {exc!r}", status=500).body()
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _adapter(server: Server, request: Request, convert, to_object, to_events, sse):
    """One adapter route: convert the request to chat, run it, convert the response (or each
    stream event: `sse` writes one as server-sent-event text)."""
    raw, result = await _adapted_chat(server, request, convert)
    if result is None:
        return Response(status_code=CLIENT_GONE)
    if isinstance(result, dict):
        return to_object(result, raw)

    async def events() -> AsyncIterator[str]:
        async for event in to_events(_error_chunks(result), raw):
            yield sse(event)

    return _EventStream(events(), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"})  # fmt: skip


async def responses(server: Server, request: Request):
    def sse(event: dict[str, Any]) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    return await _adapter(server, request, responses_to_chat, chat_to_response,
                          chat_stream_to_response_events, sse)  # fmt: skip


async def messages(server: Server, request: Request):
    def sse(event: tuple[str, dict[str, Any]]) -> str:
        return f"event: {event[0]}\ndata: {json.dumps(event[1])}\n\n"

    return await _adapter(server, request, messages_to_chat, chat_to_message,
                          chat_stream_to_message_events, sse)  # fmt: skip


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

    def model_card() -> dict[str, Any]:
        return {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "hybridkv",
            "max_model_len": server.engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    # The OpenAI SDK's `models.retrieve(id)`; ids may hold slashes ("org/name").
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await server.read_body(request, TokenizeRequest)
        if body.model is not None:
            server.check_model(body.model)
        return await asyncio.to_thread(_tokenize, server, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await server.read_body(request, DetokenizeRequest)
        if body.model is not None:
            server.check_model(body.model)
        return await asyncio.to_thread(_detokenize, server, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = _need_tokenizer(server, "tokenizer_info")
        info = {k: v for k, v in tok.config.items() if k != "added_tokens_decoder"}
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        limit = server.engine.max_model_len
        return {**info, "vocab_size": tok.vocab_size, "model_max_length": limit}

    @app.post("/v1/responses")
    async def v1_responses(request: Request):
        return await responses(server, request)

    @app.post("/v1/messages")
    async def v1_messages(request: Request):
        try:
            return await messages(server, request)
        except OpenAIError as exc:  # Anthropic's error shape on this route
            server.metrics.count_request(f"error_{exc.status}")
            if exc.status == CLIENT_GONE:
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(anthropic_error(exc.status, exc.message), status_code=exc.status)

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        return await completions(server, request)

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request):
        return await chat_completions(server, request)

    return app


def _need_tokenizer(server: Server, what: str) -> Any:
    tok = server.engine.tokenizer
    if tok is None:
        raise OpenAIError(f"this model has no tokenizer, so {what} is not available", status=404)
    return tok


def _tokenize(server: Server, body: TokenizeRequest) -> dict[str, Any]:
    tok = _need_tokenizer(server, "/tokenize")
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("give either prompt or messages", param="prompt")
    if body.messages is not None:
        chat = ChatCompletionRequest.model_validate(
            {"model": server.model_name, "messages": [m.model_dump() for m in body.messages],
             "add_generation_prompt": body.add_generation_prompt, "tools": body.tools,
             "chat_template": body.chat_template,
             "chat_template_kwargs": body.chat_template_kwargs}  # fmt: skip
        )
        text, special = server.chat_prompt(chat, body.tools), False
    else:
        assert body.prompt is not None
        text, special = body.prompt, True
    try:
        check_unicode(text, "prompt")
    except ValueError as exc:
        raise OpenAIError(str(exc), param="prompt") from None
    if body.add_special_tokens is not None:
        special = body.add_special_tokens
    ids = tok.encode(text, add_special_tokens=special)
    strs = [_token_str(tok, t) for t in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": server.engine.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def _detokenize(server: Server, body: DetokenizeRequest) -> dict[str, Any]:
    tok = _need_tokenizer(server, "/detokenize")
    vocab = server.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(f"tokens must be token ids in [0, {vocab}), got {bad[:3]}",
                          param="tokens")  # fmt: skip
    return {"prompt": tok.decode(body.tokens)}


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
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> str | None:
    """Serve until interrupted; on `sock` (from bind_socket) if given, else on host:port.
    Returns None, or the error that stopped the engine (a tensor-parallel rank died or hung):
    requests then get 503 and the server shuts down, for the caller to exit non-zero."""
    import uvicorn

    state = Server(engine, model_name, max_request_bytes, tool_parser, reasoning_parser)
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    http = uvicorn.Server(config)

    def stop(_: str) -> None:
        http.should_exit = True  # read by uvicorn's main loop; in-flight answers finish

    state.async_engine.on_fatal = stop
    http.run(sockets=[sock] if sock is not None else None)
    return state.async_engine.fatal

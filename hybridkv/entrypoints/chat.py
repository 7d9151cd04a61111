"""One chat choice's generated text -> an assistant message, whole or as stream deltas.

    generated text --> reasoning parser (if the server has one: <think>...</think>)
                          |-- reasoning_content
                          `-- content --> tool mode:
                                            none      content
                                            auto      tool-call parser of the model's format
                                                      (Hermes JSON, Qwen3-Coder XML) -> tool_calls
                                            required  a JSON array [{"name", "parameters"}, ...]
                                                      (grammar-forced) -> tool_calls
                                            named     a JSON object (grammar-forced): the
                                                      arguments of the one named call

Malformed output never raises: what cannot be read as tool calls stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridkv.entrypoints.reasoning import ReasoningParser
from hybridkv.entrypoints.tool_parsers import ContentDelta, ToolCallDelta, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ChatOutput:
    """The output state of one choice. `mode`: "none", "auto", "required", "named"."""

    mode: str
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    function: str | None = None  # the named function
    num_calls: int = 0  # tool calls streamed so far
    _buffer: list[str] = field(default_factory=list)  # "required": the JSON array so far
    _named_id: str | None = None

    # -- whole ---------------------------------------------------------------------------------

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of the whole text, and the finish reason ("tool_calls" when
        the choice ends with tool calls)."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.parse(text)
        calls: list[dict[str, Any]] = []
        if self.mode == "auto" and self.tool_parser is not None and content:
            parsed = self.tool_parser.parse(content)
            content = parsed.content
            calls = [_call(c.id, c.name, c.arguments) for c in parsed.tool_calls]
        elif self.mode in ("required", "named") and content is not None:
            calls = self._forced_calls(content)
            if calls:
                content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message, ("tool_calls" if calls and finish == "stop" else finish)

    def _forced_calls(self, text: str) -> list[dict[str, Any]]:
        try:
            value = json.loads(text)
        except ValueError:
            return []  # cut off by max_tokens: left as content
        if self.mode == "named":
            assert self.function is not None
            return [_call(call_id(), self.function, json.dumps(value, ensure_ascii=False))]
        if not isinstance(value, list):
            return []
        return [
            _call(call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in value
            if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
        ]

    # -- streamed ------------------------------------------------------------------------------

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """Delta objects for new text (possibly none: held back)."""
        pieces = [("content", text)] if self.reasoning is None else self.reasoning.feed(text)
        return self._route(pieces)

    def finish(self, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held back until the end, and the finish reason."""
        pieces = [] if self.reasoning is None else self.reasoning.finish()
        out = self._route(pieces)
        if self.mode == "auto" and self.tool_parser is not None:
            out += self._tool_deltas(self.tool_parser.finish())
        elif self.mode == "required":
            text = "".join(self._buffer)
            calls = self._forced_calls(text)
            if calls:
                out.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                self.num_calls = len(calls)
            elif text:
                out.append({"content": text})
        return out, ("tool_calls" if self.num_calls and finish == "stop" else finish)

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if not text:
                continue
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self.mode == "auto" and self.tool_parser is not None:
                out += self._tool_deltas(self.tool_parser.feed(text))
            elif self.mode == "required":
                self._buffer.append(text)
            elif self.mode == "named":
                out.append(self._named_delta(text))
            else:
                out.append({"content": text})
        return out

    def _named_delta(self, text: str) -> dict[str, Any]:
        if self._named_id is None:  # the first fragment carries the call's id and name
            self._named_id = call_id()
            self.num_calls = 1
            first = _call(self._named_id, self.function or "", text)
            return {"tool_calls": [{"index": 0, **first}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def _tool_deltas(self, items: list[ContentDelta | ToolCallDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, ContentDelta):
                if item.text:
                    out.append({"content": item.text})
                continue
            entry: dict[str, Any] = {"index": item.index}
            fn: dict[str, Any] = {"arguments": item.arguments}
            if item.id is not None:
                entry |= {"id": item.id, "type": "function"}
                self.num_calls = max(self.num_calls, item.index + 1)
            if item.name is not None:
                fn["name"] = item.name
            entry["function"] = fn
            out.append({"tool_calls": [entry]})
        return out

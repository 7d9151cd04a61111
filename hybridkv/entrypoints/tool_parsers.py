"""Tool-call parsers: a model's output text -> OpenAI tool calls, whole or while streaming.

Two formats:

- "hermes" (Hermes, Qwen2.5/Qwen3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n
  </tool_call>``, one block per call. A call is emitted when its closing tag arrives (its JSON
  is only known whole then); a block whose JSON is not a call object stays content, raw.
- "qwen3_coder" (alias "qwen3_xml"; Qwen3-Coder, Qwen3.5): ``<tool_call>\\n<function=NAME>\\n
  <parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``, also accepted without
  the tool_call tags. A call is committed (its id and name streamed, arguments "{") once its
  ``<function=NAME>`` header is complete, and each parameter is streamed when its value ends.
  Values are strings unless the request's tool schema types the parameter as
  integer/number/boolean/object/array/null (then JSON, falling back to the string); one
  leading and one trailing newline of a value are stripped. If the output ends inside a
  committed call, the call is closed with the parameters completed so far (the unfinished
  rest is dropped): it was already streamed, and `parse` agrees with the stream.

One state machine serves both `parse` (which runs a fresh copy over the whole text) and
`feed`/`finish`, so a stream split anywhere gives the same content and calls as `parse`.
Streaming holds back only a trailing piece that could be the start of a tag (say "<tool_c"),
text inside a tool-call block (until it is known to be a call or not) and, while nothing but
whitespace has been seen outside calls, that whitespace: `parse` reports content None when
only whitespace surrounds the calls, so the stream must not have sent it.

Malformed output (an unterminated block, a block that is not a call, a bad function header)
is content, the raw text, and never raises. Call ids are "call_" + 24 hex digits (uuid4),
unique per call; `parse` and a stream of the same text give different ids.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "HermesToolParser",
    "ParsedOutput",
    "Qwen3CoderToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "default_tool_parser",
    "get_tool_parser",
    "new_call_id",
    "scan_tags",
]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
# A function or parameter name longer than this is not a header: the text is given up on.
NAME_LIMIT = 256
# JSON Schema types whose values are decoded as JSON in the XML format.
_JSON_TYPES = frozenset({"integer", "number", "boolean", "object", "array", "null"})


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there are calls and only whitespace around them
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among this output's calls
    id: str | None  # only on a call's first delta
    name: str | None  # only on a call's first delta
    arguments: str  # a fragment: a call's fragments concatenate to its JSON object


Delta = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def scan_tags(buf: str, tags: Sequence[str]) -> tuple[int, str | None]:
    """Where the text of a state ends in `buf`: `(position, tag)` of the earliest complete tag
    (the longer one on a tie), else `(n, None)` where `buf[:n]` cannot be part of any tag and
    `buf[n:]` is the longest tail that could still grow into one (to hold back).

    Deciding on complete tags only, and holding partial ones, is what makes a stream's result
    independent of where it was split."""
    found: str | None = None
    best = -1
    for tag in tags:
        pos = buf.find(tag)
        if pos >= 0 and (found is None or pos < best or (pos == best and len(tag) > len(found))):
            best, found = pos, tag
    if found is not None:
        return best, found
    return len(buf) - _partial_tail(buf, tags), None


def _partial_tail(buf: str, tags: Sequence[str]) -> int:
    longest = max((len(tag) for tag in tags), default=1) - 1
    for k in range(min(longest, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(tag.startswith(tail) for tag in tags):
            return k
    return 0


def _assemble(items: list[Delta]) -> ParsedOutput:
    content = "".join(item.text for item in items if isinstance(item, ContentDelta))
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for item in items:
        if isinstance(item, ToolCallDelta):
            if item.index not in calls:
                calls[item.index] = (item.id or new_call_id(), item.name or "", [])
            calls[item.index][2].append(item.arguments)
    tool_calls = [ToolCall(cid, name, "".join(parts)) for cid, name, parts in calls.values()]
    return ParsedOutput(None if tool_calls and not content.strip() else content, tool_calls)


class ToolParser(ABC):
    """One choice's output: `parse` a whole text, or `feed` deltas then `finish` once.

    Subclasses are tag-driven state machines: `_tags` names the tags that end the current
    state's text, `_on_text` takes that text (in pieces, however the stream was split),
    `_on_tag` a complete tag, and `_flush` settles the state at the end of the output."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = list(tools or [])
        self._buf = ""  # text not yet given to the state (a possible partial tag)
        self._state = "content"
        self._calls = 0  # calls started
        self._blank = ""  # leading whitespace-only content, held (see the module docstring)
        self._spoke = False  # non-whitespace content was emitted

    # -- public ---------------------------------------------------------------------------------

    def parse(self, text: str) -> ParsedOutput:
        """Content and calls of a whole output (does not touch this parser's stream state)."""
        fresh = type(self)(self.tools)
        return _assemble(fresh.feed(text) + fresh.finish())

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        self._buf += delta
        self._run(out)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        self._run(out)
        self._flush(out)
        self._buf = ""
        if self._blank and not self._calls:
            out.append(ContentDelta(self._blank))
        self._blank = ""
        return out

    # -- machinery -------------------------------------------------------------------------------

    def _run(self, out: list[Delta]) -> None:
        while True:
            pos, tag = scan_tags(self._buf, self._tags())
            if tag is None and pos == 0:
                return
            text, state = self._buf[:pos], self._state
            self._buf = self._buf[pos + len(tag or "") :]
            if text:
                self._on_text(text, out)
            if tag is not None and self._state != state:  # the text ended the state: the tag
                self._push_back(tag)  # belongs to the next one
            elif tag is not None:
                self._on_tag(tag, out)

    def _content(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self._spoke:
            out.append(ContentDelta(text))
            return
        self._blank += text
        if self._blank.strip():
            out.append(ContentDelta(self._blank))
            self._blank, self._spoke = "", True

    def _start_call(self, name: str, arguments: str, out: list[Delta]) -> None:
        out.append(ToolCallDelta(self._calls, new_call_id(), name, arguments))
        self._calls += 1

    def _arguments(self, fragment: str, out: list[Delta]) -> None:
        out.append(ToolCallDelta(self._calls - 1, None, None, fragment))

    def _push_back(self, text: str) -> None:
        """Have `text` read again, in the state just entered."""
        self._buf = text + self._buf

    @abstractmethod
    def _tags(self) -> tuple[str, ...]: ...

    @abstractmethod
    def _on_text(self, text: str, out: list[Delta]) -> None: ...

    @abstractmethod
    def _on_tag(self, tag: str, out: list[Delta]) -> None: ...

    @abstractmethod
    def _flush(self, out: list[Delta]) -> None: ...


# -- Hermes JSON --------------------------------------------------------------------------------


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's body, or None when it is not a call object."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name = "hermes"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._body = ""

    def _tags(self) -> tuple[str, ...]:
        return (TOOL_CALL_START,) if self._state == "content" else (TOOL_CALL_END,)

    def _on_text(self, text: str, out: list[Delta]) -> None:
        if self._state == "content":
            self._content(text, out)
        else:
            self._body += text

    def _on_tag(self, tag: str, out: list[Delta]) -> None:
        if tag == TOOL_CALL_START:
            self._state, self._body = "call", ""
            return
        call = _hermes_call(self._body)
        if call is None:
            self._content(TOOL_CALL_START + self._body + TOOL_CALL_END, out)
        else:
            self._start_call(call[0], call[1], out)
        self._state = "content"

    def _flush(self, out: list[Delta]) -> None:
        if self._state == "content":
            self._content(self._buf, out)
        else:  # unterminated block: raw content
            self._content(TOOL_CALL_START + self._body + self._buf, out)


# -- Qwen3-Coder XML ----------------------------------------------------------------------------


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (`type` as a string or list, anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind or [] if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types |= _schema_types(option)
    return types


def _parameter_schemas(tools: list[dict]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' schemas, from an OpenAI `tools` list (defensive: a
    malformed entry is skipped, the request's validation is not this module's job)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def typed_value(value: str, types: set[str]) -> Any:
    """An XML parameter's text as the schema types it: a string unless the schema allows only
    non-string JSON types; then JSON ("True"/"False" accepted for booleans), else the text."""
    if not types or "string" in types or not types & _JSON_TYPES:
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    word = value.strip().lower()
    if "boolean" in types and word in ("true", "false"):
        return word == "true"
    return value


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``.

    States: "content"; "block" (inside <tool_call>, between functions); "function_header"
    (after "<function=", reading the name up to ">"); "function" (between parameters);
    "parameter_header"; "value" (a parameter's value, up to </parameter> or </function>)."""

    name = "qwen3_coder"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._schemas = _parameter_schemas(self.tools)
        self._in_block = False  # the current function sits inside <tool_call> tags
        self._block_calls = 0  # functions committed in the current block
        self._raw = ""  # the current block's text, for when it turns out not to be a call
        self._acc = ""  # the header or value being read
        self._function = ""  # the current call's name
        self._key = ""  # the current parameter's name
        self._params = 0  # parameters streamed in the current call

    def _tags(self) -> tuple[str, ...]:
        state = self._state
        if state == "content":
            return (TOOL_CALL_START, FUNCTION_START)
        if state == "block":
            return (FUNCTION_START, TOOL_CALL_END)
        if state in ("function_header", "parameter_header"):
            return (">", "\n", "<")
        if state == "function":
            return (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
        return (PARAMETER_END, FUNCTION_END)  # value

    def _on_text(self, text: str, out: list[Delta]) -> None:
        state = self._state
        if state == "content":
            self._content(text, out)
        elif state == "block":
            self._raw += text
        elif state in ("function_header", "parameter_header"):
            self._acc += text
            if len(self._acc) > NAME_LIMIT:
                self._bad_header(out)
        elif state == "value":
            self._acc += text
        # "function": text between parameters (whitespace) is dropped

    def _on_tag(self, tag: str, out: list[Delta]) -> None:
        handler = {
            "content": self._tag_in_content,
            "block": self._tag_in_block,
            "function_header": self._tag_in_header,
            "parameter_header": self._tag_in_header,
            "function": self._tag_in_function,
            "value": self._tag_in_value,
        }[self._state]
        handler(tag, out)

    def _tag_in_content(self, tag: str, out: list[Delta]) -> None:
        if tag == TOOL_CALL_START:
            self._state, self._in_block, self._block_calls, self._raw = "block", True, 0, ""
        else:
            self._state, self._in_block, self._acc = "function_header", False, ""

    def _tag_in_block(self, tag: str, out: list[Delta]) -> None:
        if tag == FUNCTION_START:
            self._state, self._acc = "function_header", ""
            return
        if not self._block_calls:  # a block without a function: raw content
            self._content(TOOL_CALL_START + self._raw + TOOL_CALL_END, out)
        self._state = "content"

    def _tag_in_header(self, tag: str, out: list[Delta]) -> None:
        name = self._acc.strip()
        if tag != ">" or not name:
            self._push_back("" if tag == ">" else tag)
            self._bad_header(out, ">" if tag == ">" else "")
        elif self._state == "function_header":
            self._function, self._params, self._state = name, 0, "function"
            self._block_calls += 1
            self._start_call(name, "{", out)
        else:
            self._key, self._acc, self._state = name, "", "value"

    def _bad_header(self, out: list[Delta], extra: str = "") -> None:
        """A header that cannot be one: a parameter's is dropped; a function's is content
        (with its block, when the block has no call yet), or dropped inside a block that has."""
        if self._state == "parameter_header":
            self._state = "function"
            return
        raw = FUNCTION_START + self._acc + extra
        if not self._in_block:
            self._content(raw, out)
            self._state = "content"
        elif not self._block_calls:
            self._content(TOOL_CALL_START + self._raw + raw, out)
            self._state = "content"
        else:
            self._state = "block"

    def _tag_in_function(self, tag: str, out: list[Delta]) -> None:
        if tag == PARAMETER_START:
            self._state, self._acc = "parameter_header", ""
            return
        self._close_call(out)
        self._state = "block" if tag == FUNCTION_END and self._in_block else "content"

    def _tag_in_value(self, tag: str, out: list[Delta]) -> None:
        self._parameter(out)
        if tag == PARAMETER_END:
            self._state = "function"
        else:  # </function> with the </parameter> missing
            self._close_call(out)
            self._state = "block" if self._in_block else "content"

    def _parameter(self, out: list[Delta]) -> None:
        types = _schema_types(self._schemas.get(self._function, {}).get(self._key))
        value = typed_value(_strip_one_newline(self._acc), types)
        prefix = ", " if self._params else ""
        key = json.dumps(self._key, ensure_ascii=False)
        self._arguments(f"{prefix}{key}: {json.dumps(value, ensure_ascii=False)}", out)
        self._params += 1
        self._acc = ""

    def _close_call(self, out: list[Delta]) -> None:
        self._arguments("}", out)

    def _flush(self, out: list[Delta]) -> None:
        if self._state == "function_header":
            self._bad_header(out)
        if self._state == "content":
            self._content(self._buf, out)
        elif self._state == "block":
            if not self._block_calls:
                self._content(TOOL_CALL_START + self._raw + self._buf, out)
        else:  # inside a committed call: close it with the parameters completed so far
            self._close_call(out)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
}


def lookup(registry: dict[str, Any], name: str, what: str) -> Any:
    """registry[name], or a ValueError naming the valid names."""
    try:
        return registry[name]
    except KeyError:
        valid = ", ".join(sorted(registry))
        raise ValueError(f"unknown {what} {name!r}; valid: {valid}") from None


def get_tool_parser(name: str) -> type[ToolParser]:
    return lookup(TOOL_PARSERS, name, "tool parser")


def default_tool_parser(chat_template: str | None) -> str:
    """The parser for a model's chat template: "qwen3_coder" when the template renders calls
    as ``<function=NAME>`` XML, else "hermes"."""
    if chat_template is not None and FUNCTION_START in chat_template:
        return "qwen3_coder"
    return "hermes"

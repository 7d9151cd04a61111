"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

A model's chat template is Jinja text shipped in its tokenizer config. Prompts must match the
ones the model was trained on byte for byte, so the environment here reproduces the one
transformers builds (transformers/utils/chat_template_utils.py):

- an `ImmutableSandboxedEnvironment` (templates come from the Hub: untrusted code) with
  `trim_blocks=True`, `lstrip_blocks=True` and the `loopcontrols` extension (`break`,
  `continue`), plus a `{% generation %}` block that only renders its body (transformers
  uses it to find assistant tokens; a template that has it must still compile here);
- the `tojson` filter replaced by `json.dumps` with `ensure_ascii=False` and the `indent`,
  `separators`, `sort_keys` options (Jinja's own escapes HTML characters);
- the globals `raise_exception(message)`, `strftime_now(format)`, a `dict` that only builds
  dicts and a `namespace` that refuses underscore-prefixed attributes;
- the messages as transformers prepares them: keys whose value is None dropped, a fresh
  plain-data copy (the caller's dicts are never modified), the reasoning text copied under
  `reasoning_content` and `thinking` from whichever of those names (or `reasoning`) holds it.

Every error (a template that does not compile, `raise_exception`, a Jinja error while
rendering) is a `ValueError` with a one-line message, so a server can report it as the
request's fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "normalise_messages"]

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Errors a template's own code can cause while rendering (a filter applied to the wrong type,
# a missing key, a division by zero); all of them are the template's or the messages' fault.
_RENDER_ERRORS = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the block to mark assistant tokens for training masks; for inference
    only the text matters, but templates that contain the tag must still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """The template's `dict`: builds dicts, and offers nothing else a template could abuse."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore-prefixed attributes (a way into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _TemplateNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _TemplateNamespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: object) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes: {key!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _one_line(exc: BaseException) -> str:
    """The error's message on one line (Jinja messages can span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _plain(value: Any) -> Any:
    """A fresh copy of `value` made of plain JSON types (what the sandbox may safely see);
    anything else becomes an inert "<TypeName>" placeholder, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as transformers gives it to the template: None-valued keys dropped, the
    reasoning text under both `reasoning_content` and `thinking`."""
    if not isinstance(message, Mapping):
        raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _parsed_arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _normalise_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    if "arguments" in function:
        function["arguments"] = _parsed_arguments(function["arguments"])
    return {**call, "function": function}


def normalise_messages(messages: list[dict]) -> list[dict]:
    """Messages whose tool calls carry their `arguments` as a dict where they can.

    OpenAI clients send `tool_calls[*].function.arguments` as a JSON string. Many templates
    (Qwen3's, Qwen3-Coder's, Hermes-style ones) iterate over the arguments
    (`arguments|items`) or serialise them with `tojson`, which only renders as the model was
    trained when they are a mapping; transformers passes them on as given. So this parses a
    string that holds a JSON object into a dict (vLLM does the same), and leaves any other
    string (unparsable, or JSON that is not an object) as it was.

    Returns new message dicts (shallow copies where something changed); the input is not
    modified."""
    out: list[dict] = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_normalise_call(c) for c in calls]}
        out.append(message)
    return out


# The template of a tokenizer without one: every message as "<|role|>\n{content}\n", then
# "<|assistant|>\n".
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def token_text(token: Any) -> str:
    """A tokenizer_config.json special token's text (a string, or an AddedToken dict)."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return str(token or "")


# what `ChatTemplate.render` sets from its own arguments: template kwargs may not set these
RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")


def template_variables(
    tokenizer_config: Mapping[str, Any], template_kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The extra variables of a render: the tokenizer's `bos_token` and `eos_token` texts, then
    a request's `chat_template_kwargs` (which may override them, as in transformers).
    ValueError (one line) for kwargs that name what the render sets from the request itself."""
    kwargs = dict(template_kwargs or {})
    taken = sorted(k for k in kwargs if k in RENDER_ARGUMENTS)
    if taken:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(taken)} (set by the request itself: "
            "its messages, tools and add_generation_prompt)"
        )
    specials = {n: token_text(tokenizer_config.get(n)) for n in ("bos_token", "eos_token")}
    return {**specials, **kwargs}


class ChatTemplate:
    """A compiled chat template (compile once, render per request)."""

    def __init__(self, source: str) -> None:
        """Compile `source`; ValueError (one line) when it is not a valid template."""
        if not isinstance(source, str):
            raise ValueError(f"a chat template must be a string, got {type(source).__name__}")
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"invalid chat template: {_one_line(exc)}") from None

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        bos_token: str = "",
        eos_token: str = "",
        **kwargs: Any,
    ) -> str:
        """The prompt text of `messages` (and the `tools` offered).

        `kwargs` are extra template variables (a request's `chat_template_kwargs`, e.g.
        `enable_thinking=False`); they override `bos_token`/`eos_token` when they name them,
        as in transformers. ValueError (one line) when the template raises or fails."""
        variables = {"bos_token": bos_token, "eos_token": eos_token, **_plain(kwargs)}
        try:
            chat = [_prepare_message(m) for m in messages]
            return self._template.render(
                messages=chat,
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _RENDER_ERRORS as exc:
            raise ValueError(_one_line(exc)) from None

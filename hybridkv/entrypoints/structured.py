"""Request fields -> the grammar a request's output must follow (`hybridkv.structured`).

Accepted spellings, at most one per request:

    response_format {"type": "json_object"}                        any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": ..., "strict": ...}}
    guided_json (a schema, object or JSON text) / guided_regex / guided_choice / guided_grammar
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM)

and, for chat requests with tools, `tool_choice` "required" (a JSON array of one or more
{"name", "parameters"} calls, each name one of the tools) or a named function (a JSON object
of that function's parameters). The server turns such output into `tool_calls` itself, so the
arguments always parse, whatever the model's own tool-call format.
"""

from __future__ import annotations

import json
from typing import Any

from hybridkv.entrypoints.protocol import OpenAIError
from hybridkv.structured import GrammarSpec

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise OpenAIError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise OpenAIError(f"{param} must be a JSON schema (an object)", param=param)
    return json.dumps(schema, separators=(",", ":"))


def _from_response_format(fmt: dict[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise OpenAIError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                param="response_format.json_schema",
            )
        return GrammarSpec("json_schema", _schema_text(inner["schema"], "response_format.schema"))
    raise OpenAIError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def _from_vllm(body: Any) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    if body.guided_json is not None:
        schema = _schema_text(body.guided_json, "guided_json")
        found.append(("guided_json", GrammarSpec("json_schema", schema)))
    if body.guided_regex is not None:
        found.append(("guided_regex", GrammarSpec("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", GrammarSpec("grammar", body.guided_grammar)))
    for key, value in (body.structured_outputs or {}).items():
        param = f"structured_outputs.{key}"
        if value is None or value is False:
            continue
        if key == "json_object":
            found.append((param, GrammarSpec("json_object", "")))
        elif key == "json":
            found.append((param, GrammarSpec("json_schema", _schema_text(value, param))))
        elif key == "choice":
            found.append((param, _choice(value, param)))
        elif key in _VLLM_KINDS:
            if not isinstance(value, str):
                raise OpenAIError(f"{param} must be a string", param=param)
            found.append((param, GrammarSpec(_VLLM_KINDS[key], value)))
        else:
            raise OpenAIError(
                f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                "json_object are)",
                param=param,
            )
    return found


def _choice(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise OpenAIError(f"{param} must be a non-empty list of strings", param=param)
    return GrammarSpec("choice", json.dumps(value))


def grammar_of(body: Any, tool_grammar: GrammarSpec | None = None) -> GrammarSpec | None:
    """The one grammar a request asks for (None: free text); two at once is a 400."""
    found = _from_vllm(body)
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if tool_grammar is not None:
        found.append(("tool_choice", tool_grammar))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise OpenAIError(f"give at most one structured-output constraint, got {names}",
                          param=found[1][0])  # fmt: skip
    backend = body.guided_decoding_backend
    if backend is not None and backend not in ("auto", BACKEND):
        raise OpenAIError(
            f"guided_decoding_backend {backend!r} is not available: this server uses {BACKEND!r}",
            param="guided_decoding_backend",
        )
    return found[0][1] if found else None


BACKEND = "llguidance"


# -- tools -----------------------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> function definition of a request's tools (type "function" only)."""
    found: dict[str, dict[str, Any]] = {}
    for k, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise OpenAIError(
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": '
                "{...}}}",
                param=f"tools.{k}",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError("a tool function needs a name", param=f"tools.{k}.function.name")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise OpenAIError("parameters must be a JSON schema object",
                              param=f"tools.{k}.function.parameters")  # fmt: skip
        found[name] = fn
    return found


def tool_mode(tool_choice: Any, tools: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    """(mode, function name): mode "none", "auto", "required" or "named"."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise OpenAIError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in tools:
            valid = ", ".join(tools) or "none"
            raise OpenAIError(f"tool_choice names function {name!r}, not one of the tools "
                              f"({valid})", param="tool_choice.function.name")  # fmt: skip
        return "named", name
    raise OpenAIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        '{"name": ...}}',
        param="tool_choice",
    )


def tool_grammar(
    mode: str, name: str | None, tools: dict[str, dict[str, Any]], parallel: bool
) -> GrammarSpec | None:
    """The grammar of "required" (an array of calls) or a named function (its arguments)."""
    if mode == "named":
        assert name is not None
        return GrammarSpec("json_schema", _schema_text(_parameters(tools[name]), "tools"))
    if mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "parameters": _parameters(fn)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for n, fn in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")))


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}

"""ChatTemplate renders exactly what transformers' apply_chat_template renders.

The two templates below are written for these tests, shaped like the real ones: a
Hermes/Qwen3-style template (JSON tool calls in <tool_call> tags, tool results in
<tool_response> user turns, <think> blocks, `enable_thinking`) and a Qwen3-Coder-style XML
template (<function=NAME><parameter=KEY> calls, tools listed as XML signatures)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.entrypoints.chat_template import ChatTemplate, normalise_messages

TOKENIZER = Path(__file__).resolve().parents[2] / "hybridkv" / "default_model" / "tokenizer.json"

HERMES_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and " }}
    {{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string
            else '' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if reasoning %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.lstrip('\n') }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {%- if loop.first and content %}
                {{- '\n' }}
            {%- elif not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

XML_TEMPLATE = r"""
{%- macro render_extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- set value = json_dict[json_key] %}
            {%- if value is mapping or (value is sequence and value is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (value | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{- '\n<' ~ json_key ~ '>' ~ (value | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set system_message = messages[0].content if messages and messages[0].role == 'system'
    else none %}
{%- set loop_messages = messages[1:] if system_message is not none else messages %}
{%- if system_message is not none or tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system_message is not none %}
        {{- system_message }}
    {%- else %}
        {{- 'You are a helpful coding assistant.' }}
    {%- endif %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
        {%- for tool in tools %}
            {%- set tool = tool.function if tool.function is defined else tool %}
            {{- '\n<function>\n<name>' ~ tool.name ~ '</name>' }}
            {%- if tool.description is defined %}
                {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
            {%- endif %}
            {{- '\n<parameters>' }}
            {%- if tool.parameters is defined and tool.parameters is mapping
                and tool.parameters.properties is defined %}
                {%- for name, spec in tool.parameters.properties | items %}
                    {{- '\n<parameter>\n<name>' ~ name ~ '</name>' }}
                    {%- if spec.type is defined %}
                        {{- '\n<type>' ~ (spec.type | string) ~ '</type>' }}
                    {%- endif %}
                    {%- if spec.description is defined %}
                        {{- '\n<description>' ~ (spec.description | trim) ~ '</description>' }}
                    {%- endif %}
                    {{- render_extra_keys(spec, ['name', 'type', 'description']) }}
                    {{- '\n</parameter>' }}
                {%- endfor %}
            {%- endif %}
            {{- render_extra_keys(tool.parameters, ['type', 'properties']) }}
            {{- '\n</parameters>\n</function>' }}
        {%- endfor %}
        {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format '
            'with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n'
            '<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n'
            '</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined
        and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string
            and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- set tool_call = tool_call.function if tool_call.function is defined
                else tool_call %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments | items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe
                        if args_value is mapping or (args_value is sequence
                        and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role in ['user', 'system', 'assistant'] %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.previtem and loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' + message.content + '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "days": {"type": "integer", "description": "Forecast days", "minimum": 1},
                    "units": {"type": "string", "enum": ["metric", "imperial"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet.\n",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}, "env": {"type": "object"}},
            },
        },
    },
]

PLAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'Hi! «quoted» "text"'},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]

CALLS = [
    {"role": "user", "content": "Weather in Zürich for 3 days, then print it."},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "\nI should call the tool.\n",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Zürich", "days": 3}',
                },
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {
                    "name": "run_python",
                    "arguments": json.dumps(
                        {"code": 'print("hi")\nprint(1)', "env": {"A": [1, 2]}}
                    ),
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny, 21°C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "hi\n1"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))


def _expected(tok: Any, source: str, messages: list[dict], **kwargs: Any) -> str:
    tok.chat_template = source
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


CASES = {
    "plain": (PLAIN, None, {}),
    "tools": (PLAIN, TOOLS, {}),
    "tool_calls": (CALLS, TOOLS, {}),
    "no_thinking": (CALLS, TOOLS, {"enable_thinking": False}),
    "no_generation_prompt": (PLAIN, None, {"add_generation_prompt": False}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("source", [HERMES_TEMPLATE, XML_TEMPLATE], ids=["hermes", "xml"])
def test_render_equals_transformers(tokenizer: Any, source: str, case: str) -> None:
    messages, tools, kwargs = CASES[case]
    messages = normalise_messages(messages)
    kwargs = {"add_generation_prompt": True, **kwargs}
    got = ChatTemplate(source).render(messages, tools=tools, **kwargs)
    assert got == _expected(tokenizer, source, messages, tools=tools, **kwargs)


def test_rendered_shapes() -> None:
    """The test templates do render what they claim (so the comparison above means something)."""
    messages = normalise_messages(CALLS)
    hermes = ChatTemplate(HERMES_TEMPLATE).render(messages, tools=TOOLS, enable_thinking=False)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in hermes
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}'
    assert call in hermes
    assert "<|im_start|>user\n<tool_response>\nSunny, 21°C\n</tool_response>" in hermes
    assert "<think>\nI should call the tool.\n</think>\n\n<tool_call>" in hermes
    assert hermes.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    xml = ChatTemplate(XML_TEMPLATE).render(messages, tools=TOOLS)
    assert '<function=run_python>\n<parameter=code>\nprint("hi")\nprint(1)\n</parameter>' in xml
    assert '<parameter=env>\n{"A": [1, 2]}\n</parameter>\n</function>\n</tool_call>' in xml
    assert "<parameter>\n<name>days</name>\n<type>integer</type>" in xml
    assert "<minimum>1</minimum>" in xml
    assert xml.endswith("<|im_start|>assistant\n")


def test_none_valued_keys_are_dropped_and_input_untouched(tokenizer: Any) -> None:
    source = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    messages = [{"role": "assistant", "content": None, "tool_calls": None, "thinking": "t"}]
    before = copy.deepcopy(messages)
    got = ChatTemplate(source).render(messages, add_generation_prompt=False)
    assert got == _expected(tokenizer, source, messages)
    assert got == '{"thinking": "t", "role": "assistant", "reasoning_content": "t"}\n'
    assert messages == before


def test_special_tokens_and_kwargs_override() -> None:
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}|{{ extra }}")
    messages = [{"role": "user", "content": "x"}]
    assert t.render(messages, bos_token="<s>", eos_token="</s>", extra=1) == "<s>x</s>|1"
    assert t.render(messages) == "x|"


def test_generation_block_and_loop_controls(tokenizer: Any) -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ {'é': 1, 'a': [1]} | tojson(sort_keys=true) }}"
    )
    got = ChatTemplate(source).render(PLAIN, add_generation_prompt=False)
    assert got == _expected(tokenizer, source, PLAIN)
    assert got == 'Hi! «quoted» "text"Hello.4{"a": [1], "é": 1}'


def test_raise_exception_is_a_one_line_value_error() -> None:
    template = ChatTemplate(XML_TEMPLATE)
    with pytest.raises(ValueError, match="^unexpected message role: robot$"):
        template.render([{"role": "robot", "content": "beep"}])
    multi = ChatTemplate("{{ raise_exception('first line\nsecond line') }}")
    with pytest.raises(ValueError, match="^first line second line$"):
        multi.render([])


def test_render_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        ChatTemplate("{{ messages[0].content.items() | list }}").render(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ValueError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(ValueError):  # the sandbox refuses internals
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.mro() }}").render([])


def test_invalid_template_is_a_one_line_value_error() -> None:
    with pytest.raises(ValueError, match="^invalid chat template: ") as info:
        ChatTemplate("{% for m in messages %}\n{{ m.content }\n")
    assert "\n" not in str(info.value)


def _call(cid: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_normalise_messages() -> None:
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("a", "f", '{"k": [1]}'),
                _call("b", "g", "{oops"),
                _call("c", "h", "[1, 2]"),
                _call("d", "i", {"z": 1}),
            ],
        },
    ]
    before = copy.deepcopy(messages)
    out = normalise_messages(messages)
    args = [c["function"]["arguments"] for c in out[1]["tool_calls"]]
    assert args == [{"k": [1]}, "{oops", "[1, 2]", {"z": 1}]
    assert out[0] == messages[0]
    assert out[1]["tool_calls"][0]["id"] == "a"
    assert messages == before

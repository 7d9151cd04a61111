"""Tool-call parsers: whole outputs, and streams split anywhere giving the same result."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    HermesToolParser,
    ParsedOutput,
    Qwen3CoderToolParser,
    ToolCallDelta,
    ToolParser,
    default_tool_parser,
    get_tool_parser,
    typed_value,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "detailed": {"type": "boolean"},
                    "ratio": {"type": ["number", "null"]},
                    "options": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "zone": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]

HERMES_OUTPUTS = {
    "content_then_two_calls": (
        "Let me look that up for you.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "a/b.txt", "content": '
        '"He said \\"hi\\" 👋\\nline 2 <tool_call> inside", "meta": {"nested": [1, {"x": null}], '
        '"ok": true}}}\n</tool_call>'
    ),
    "only_calls": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    ),
    "calls_then_content": (
        '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone, 完成. <b>bold</b> < 3'
    ),
    "string_arguments": (
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>'
    ),
    "no_calls": "Just an answer with a < sign and <tool> and </tool_call> stray.",
    "blank": "  \n",
}

XML_OUTPUTS = {
    "content_then_two_calls": (
        "I'll check the weather and save it.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
        "<parameter=days>\n5\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n"
        "<parameter=ratio>\n0.25\n</parameter>\n"
        '<parameter=options>\n{"unit": "C", "hours": [1, 2]}\n</parameter>\n'
        '<parameter=tags>\n["a", "b \\"c\\""]\n</parameter>\n'
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/x.py\n</parameter>\n"
        "<parameter=content>\ndef f():\n    return \"<b>\" + 'x'\n\n# done ✓\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    "bare_function": (
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=zone>\nnull\n</parameter>\n</function>\nAfter."
    ),
    "untyped_and_unknown": (
        "<tool_call>\n<function=unknown_tool>\n<parameter=n>\n42\n</parameter>\n"
        "<parameter=s>\n\n two blank-edged lines \n\n</parameter>\n</function>\n</tool_call>"
    ),
    "two_functions_one_block": (
        "<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n"
        "</parameter>\n</function>\n</tool_call>"
    ),
    "missing_parameter_close": (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</function>\n</tool_call>"
    ),
    "no_calls": "No tools needed: use <func> or <function> tags < 3.",
}


def _splits(text: str) -> Iterator[list[str]]:
    """Pieces of every length 1..len(text), and a few random splits."""
    for size in range(1, len(text) + 1):
        yield [text[k : k + size] for k in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _calls(parsed: ParsedOutput) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    """Content and calls reconstructed from a stream, checking the delta contract."""
    items: list[ContentDelta | ToolCallDelta] = []
    for piece in pieces:
        items += parser.feed(piece)
    items += parser.finish()
    calls: dict[int, list[Any]] = {}
    for item in items:
        if isinstance(item, ToolCallDelta):
            first = item.index not in calls
            assert (item.id is not None, item.name is not None) == (first, first)
            if first:
                assert item.index == len(calls)
                assert item.id.startswith("call_") and len(item.id) == 29
                calls[item.index] = [item.name, ""]
            calls[item.index][1] += item.arguments
    content = "".join(i.text for i in items if isinstance(i, ContentDelta))
    return content, [(name, json.loads(args)) for name, args in calls.values()]


def _check_streams(cls: type[ToolParser], text: str) -> ParsedOutput:
    parsed = cls(TOOLS).parse(text)
    expected = (parsed.content or "", _calls(parsed))
    for pieces in _splits(text):
        assert _stream(cls(TOOLS), pieces) == expected, pieces
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == len(ids)
    return parsed


@pytest.mark.parametrize("case", sorted(HERMES_OUTPUTS))
def test_hermes_streams_like_parse(case: str) -> None:
    _check_streams(HermesToolParser, HERMES_OUTPUTS[case])


@pytest.mark.parametrize("case", sorted(XML_OUTPUTS))
def test_xml_streams_like_parse(case: str) -> None:
    _check_streams(Qwen3CoderToolParser, XML_OUTPUTS[case])


def test_hermes_parse() -> None:
    parsed = HermesToolParser().parse(HERMES_OUTPUTS["content_then_two_calls"])
    assert parsed.content == "Let me look that up for you.\n\n"
    assert _calls(parsed) == [
        ("get_weather", {"city": "Zürich", "days": 3}),
        (
            "write_file",
            {
                "path": "a/b.txt",
                "content": 'He said "hi" 👋\nline 2 <tool_call> inside',
                "meta": {"nested": [1, {"x": None}], "ok": True},
            },
        ),
    ]
    # arguments re-serialised with json.dumps(ensure_ascii=False)
    assert parsed.tool_calls[0].arguments == '{"city": "Zürich", "days": 3}'
    assert HermesToolParser().parse(HERMES_OUTPUTS["only_calls"]).content is None
    after = HermesToolParser().parse(HERMES_OUTPUTS["calls_then_content"])
    assert after.content == "\n\nDone, 完成. <b>bold</b> < 3"
    assert _calls(HermesToolParser().parse(HERMES_OUTPUTS["string_arguments"])) == [
        ("f", {"a": [1, 2]})
    ]
    for case in ("no_calls", "blank"):
        text = HERMES_OUTPUTS[case]
        assert HermesToolParser().parse(text) == ParsedOutput(text, [])


def test_xml_parse_types_values_by_schema() -> None:
    parsed = Qwen3CoderToolParser(TOOLS).parse(XML_OUTPUTS["content_then_two_calls"])
    assert parsed.content == "I'll check the weather and save it.\n\n\n"
    assert _calls(parsed) == [
        (
            "get_weather",
            {
                "city": "São Paulo",
                "days": 5,
                "detailed": True,
                "ratio": 0.25,
                "options": {"unit": "C", "hours": [1, 2]},
                "tags": ["a", 'b "c"'],
            },
        ),
        (
            "write_file",
            {"path": "/tmp/x.py", "content": "def f():\n    return \"<b>\" + 'x'\n\n# done ✓"},
        ),
    ]
    bare = Qwen3CoderToolParser(TOOLS).parse(XML_OUTPUTS["bare_function"])
    assert bare.content == "\nAfter."
    assert _calls(bare) == [("get_weather", {"city": "Oslo", "zone": None})]
    untyped = Qwen3CoderToolParser(TOOLS).parse(XML_OUTPUTS["untyped_and_unknown"])
    assert untyped.content is None
    assert _calls(untyped) == [("unknown_tool", {"n": "42", "s": "\n two blank-edged lines \n"})]
    two = Qwen3CoderToolParser().parse(XML_OUTPUTS["two_functions_one_block"])
    assert _calls(two) == [("a", {}), ("b", {"x": "1"})]
    assert two.tool_calls[0].arguments == "{}"
    missing = Qwen3CoderToolParser(TOOLS).parse(XML_OUTPUTS["missing_parameter_close"])
    assert _calls(missing) == [("get_weather", {"days": 7})]
    text = XML_OUTPUTS["no_calls"]
    assert Qwen3CoderToolParser(TOOLS).parse(text) == ParsedOutput(text, [])


def test_typed_value() -> None:
    assert typed_value("3", {"integer"}) == 3
    assert typed_value("three", {"integer"}) == "three"
    assert typed_value("True", {"boolean"}) is True
    assert typed_value("null", {"number", "null"}) is None
    assert typed_value("3", {"string", "integer"}) == "3"
    assert typed_value("[1]", set()) == "[1]"
    assert typed_value('{"a": 1', {"object"}) == '{"a": 1'


HERMES_MALFORMED = [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # unterminated
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # invalid JSON
    "<tool_call>not json at all</tool_call> and after",
    '<tool_call>[{"name": "f"}]</tool_call>',
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>',
    "<tool_call>",
    "text <tool_c",
]

XML_MALFORMED = [
    "<tool_call>\nplain words, no function\n</tool_call> tail",
    "<tool_call>\n<function=get_wea",  # truncated header
    "<tool_call>\n<function=bad name\nmore>\n</tool_call>",
    "<function=>\n<parameter=a>\n1\n</parameter>\n</function>",  # empty name
    "<function=" + "x" * 300 + ">",  # too long to be a name
    "<tool_call>",
    "text <function",
]


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_is_content(text: str) -> None:
    assert HermesToolParser().parse(text) == ParsedOutput(text, [])
    _check_streams(HermesToolParser, text)


@pytest.mark.parametrize("text", XML_MALFORMED)
def test_xml_malformed_is_content(text: str) -> None:
    assert Qwen3CoderToolParser(TOOLS).parse(text) == ParsedOutput(text, [])
    _check_streams(Qwen3CoderToolParser, text)


def test_xml_truncated_call_is_closed() -> None:
    """A committed call (its header streamed) that the output cuts off keeps the parameters
    completed so far; the unfinished one is dropped."""
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
        "<parameter=content>\nhalf a val"
    )
    parsed = _check_streams(Qwen3CoderToolParser, text)
    assert parsed.content is None
    assert _calls(parsed) == [("write_file", {"path": "a.txt"})]
    junk = "<tool_call>\n<function=f>\n</function>\n<function=bad\n</tool_call>"
    assert _calls(_check_streams(Qwen3CoderToolParser, junk)) == [("f", {})]


def test_hold_back_only_a_possible_tag_start() -> None:
    hermes = HermesToolParser()
    assert hermes.feed("Hello <tool_c") == [ContentDelta("Hello ")]
    assert hermes.feed("x") == [ContentDelta("<tool_cx")]
    assert hermes.feed(" a < b") == [ContentDelta(" a < b")]
    assert hermes.feed(" <") == [ContentDelta(" ")]
    assert hermes.finish() == [ContentDelta("<")]
    xml = Qwen3CoderToolParser(TOOLS)
    assert xml.feed("Sure <func") == [ContentDelta("Sure ")]
    assert xml.finish() == [ContentDelta("<func")]


def test_leading_whitespace_is_held_until_content() -> None:
    """Whitespace alone before the first call is not content (parse says None)."""
    parser = HermesToolParser()
    assert parser.feed("\n\n") == []
    assert parser.feed("Hi") == [ContentDelta("\n\nHi")]
    parser = HermesToolParser()
    assert parser.feed("\n") == []
    assert parser.finish() == [ContentDelta("\n")]


def test_xml_streams_each_parameter_when_complete() -> None:
    parser = Qwen3CoderToolParser(TOOLS)
    first = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nRo")
    assert len(first) == 1 and isinstance(first[0], ToolCallDelta)
    assert (first[0].index, first[0].name, first[0].arguments) == (0, "get_weather", "{")
    assert parser.feed("me\n</parameter>\n") == [ToolCallDelta(0, None, None, '"city": "Rome"')]
    assert parser.feed("<parameter=days>\n2\n</parameter>\n</function>") == [
        ToolCallDelta(0, None, None, ', "days": 2'),
        ToolCallDelta(0, None, None, "}"),
    ]
    assert parser.feed("\n</tool_call>") == []
    assert parser.finish() == []


def test_hermes_streams_call_on_closing_tag() -> None:
    parser = HermesToolParser()
    assert parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_') == []
    (delta,) = parser.feed("call>")
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"a": 1}')
    assert delta.id is not None


def test_parse_leaves_stream_state_alone() -> None:
    parser = HermesToolParser()
    assert parser.feed("a <tool_") == [ContentDelta("a ")]
    parser.parse('<tool_call>{"name": "f"}</tool_call>')
    assert parser.feed("call>") == []
    assert parser.finish() == [ContentDelta("<tool_call>")]


def test_registry() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    assert get_tool_parser("qwen3_xml") is Qwen3CoderToolParser
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "qwen3_xml"}
    with pytest.raises(ValueError, match="hermes, qwen3_coder, qwen3_xml") as info:
        get_tool_parser("mistral")
    assert "mistral" in str(info.value)


def test_default_tool_parser() -> None:
    xml = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    assert default_tool_parser(xml) == "qwen3_coder"
    assert default_tool_parser('{{- "<tool_call>\\n" + tool_call | tojson }}') == "hermes"
    assert default_tool_parser(None) == "hermes"


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
    ">", "\n", "<", "</", "<tool", " ", "a b", "{", "}", '"', "1", "true", "get_weather", "days",
    '{"name": "f", "arguments": {"x": [1, "é"]}}',
]  # fmt: skip


@pytest.mark.parametrize("cls", [HermesToolParser, Qwen3CoderToolParser])
def test_random_tag_soup_never_raises_and_streams_like_parse(cls: type[ToolParser]) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 20)))
        parsed = cls(TOOLS).parse(text)
        expected = (parsed.content or "", _calls(parsed))
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        assert _stream(cls(TOOLS), pieces) == expected, pieces

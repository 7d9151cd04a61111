"""Reasoning parsers: whole outputs, and streams split anywhere giving the same split."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from hybridkv.entrypoints.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)

PLAIN = "Plain answer, no thinking. 3 < 4 and <thin>"
# (text, starts_in_reasoning) -> (reasoning_content, content)
CASES: dict[str, tuple[str, bool, str | None, str | None]] = {
    "qwen3": (
        "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
        False,
        "The user wants 2+2.\nThat is 4.",
        "The answer is **4**.",
    ),
    "no_block": (PLAIN, False, None, PLAIN),
    "content_before": ("Sure. <think>hmm</think>Done", False, "hmm", "Sure. Done"),
    "unclosed": ("<think>\nstill thinking… 思考\n", False, "still thinking… 思考\n", None),
    "empty_block": ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    "later_tags_are_content": (
        "<think>a</think>b <think>c</think>\n",
        False,
        "a",
        "b <think>c</think>\n",
    ),
    "only_newlines_after": ("<think>x\n</think>\n\n", False, "x", None),
    "r1_no_open_tag": (
        "Let me compute.\nOK.\n</think>\n\nIt is 4.",
        True,
        "Let me compute.\nOK.",
        "It is 4.",
    ),
    "r1_open_tag_written": ("<think>\nfoo\n</think>bar", True, "foo", "bar"),
    "r1_unclosed": ("thinking <thi", True, "thinking <thi", None),
    "r1_partial_open_at_end": ("<thi", True, "<thi", None),
    "r1_not_the_tag": ("<thinking>\n</think>x", True, "<thinking>", "x"),
    "r1_empty": ("", True, "", None),
    "empty": ("", False, None, None),
}


def _splits(text: str) -> Iterator[list[str]]:
    for size in range(1, len(text) + 1):
        yield [text[k : k + size] for k in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(5 if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    assert all(kind in ("reasoning", "content") and text for kind, text in out)
    reasoning = "".join(t for kind, t in out if kind == "reasoning")
    return reasoning, "".join(t for kind, t in out if kind == "content")


@pytest.mark.parametrize("case", sorted(CASES))
def test_parse_and_every_split(case: str) -> None:
    text, starts, reasoning, content = CASES[case]
    assert ReasoningParser(starts_in_reasoning=starts).parse(text) == (reasoning, content)
    for pieces in _splits(text):
        parser = ReasoningParser(starts_in_reasoning=starts)
        assert _stream(parser, pieces) == (reasoning or "", content or ""), pieces


def test_hold_back_only_a_possible_tag() -> None:
    parser = ReasoningParser()
    assert parser.feed("Hi <th") == [("content", "Hi ")]
    assert parser.feed("ink>\nstep one\n</thi") == [("reasoning", "step one")]
    assert parser.feed("nk>\n\n") == []
    assert parser.feed("Answer") == [("content", "Answer")]
    assert parser.finish() == []
    held = ReasoningParser()
    assert held.feed("<think>a\n") == [("reasoning", "a")]
    assert held.feed("b") == [("reasoning", "\nb")]


def test_custom_tags_and_parse_leaves_stream_alone() -> None:
    parser = ReasoningParser("<reason>", "</reason>")
    assert parser.feed("<reason>x") == [("reasoning", "x")]
    assert parser.parse("<reason>\ny\n</reason>\nz") == ("y", "z")
    assert parser.feed("</reason>w") == [("content", "w")]
    assert parser.finish() == []


def test_registry() -> None:
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert Qwen3ReasoningParser().parse("a</think>b") == (None, "a</think>b")
    assert DeepSeekR1ReasoningParser().parse("a</think>b") == ("a", "b")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3") as info:
        get_reasoning_parser("granite")
    assert "granite" in str(info.value)

"""Reasoning parsers: split a model's ``<think>...</think>`` block off its answer.

Rules (the same for `parse` and for a stream split anywhere, since `parse` runs the stream):

- Text before the opening tag is content, kept as written. Only the first block is
  reasoning: after its closing tag everything is content, later tags included.
- ``starts_in_reasoning``: the prompt already opened the block (templates whose generation
  prompt ends with "<think>\\n", DeepSeek-R1, Qwen3 thinking-only models), so the output
  starts as reasoning; an opening tag the model writes anyway at the very start is dropped.
- A block still open when the output ends is all reasoning (content None).
- Newlines: one "\\n" right after the opening tag and one right before the closing tag are
  dropped, as are all "\\n" right after the closing tag. That is the inverse of what Qwen3's
  template renders for a past turn ("<think>\\n" + reasoning + "\\n</think>\\n\\n" + content), so
  a parsed message rendered back gives the model's text.
- `parse` gives (reasoning_content, content): reasoning None when no block was opened, ""
  for an empty block; content None when empty.

Streaming holds back only a tail that could be the start of a tag (with the "\\n" before a
closing tag, which is dropped if the tag follows); with starts_in_reasoning, also the
output's first characters while they could still be the opening tag.
"""

from __future__ import annotations

from hybridkv.entrypoints.tool_parsers import lookup, scan_tags

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "get_reasoning_parser",
]

Piece = tuple[str, str]  # ("reasoning" | "content", text)


class ReasoningParser:
    """One choice's output: `parse` a whole text, or `feed` deltas then `finish` once.

    States: "before" (content, looking for the opening tag), "opening" (starts_in_reasoning:
    is the output's start the opening tag?), "first" (just opened: a "\\n" to drop),
    "reasoning", "after" (just closed: newlines to drop), "content"."""

    def __init__(
        self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False
    ) -> None:
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty")
        self.start, self.end, self.starts_in_reasoning = start, end, starts_in_reasoning
        self._buf = ""
        self._acc = ""  # "opening": the output's start, while it could be the opening tag
        self._state = "opening" if starts_in_reasoning else "before"
        self.opened = starts_in_reasoning  # a reasoning block was opened

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; this parser's stream is untouched."""
        fresh = type(self)(self.start, self.end, self.starts_in_reasoning)
        pieces = fresh.feed(text) + fresh.finish()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        content = "".join(t for kind, t in pieces if kind == "content")
        return (reasoning if fresh.opened else None), (content or None)

    def feed(self, delta: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += delta
        self._run(out)
        return _merged(out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        self._run(out)
        if self._state == "opening":  # a partial opening tag at the very end: reasoning
            self._emit("reasoning", self._acc, out)
        elif self._state == "before":
            self._emit("content", self._buf, out)
        elif self._state in ("first", "reasoning"):
            self._emit("reasoning", self._buf, out)
        self._buf, self._acc = "", ""
        return _merged(out)

    # -- machinery -------------------------------------------------------------------------------

    def _tags(self) -> tuple[str, ...]:
        if self._state == "before":
            return (self.start,)
        if self._state in ("first", "reasoning"):
            return ("\n" + self.end, self.end)
        return ()

    def _run(self, out: list[Piece]) -> None:
        while True:
            tags = self._tags()
            pos, tag = scan_tags(self._buf, tags) if tags else (len(self._buf), None)
            if tag is None and pos == 0:
                return
            text, state = self._buf[:pos], self._state
            self._buf = self._buf[pos + len(tag or "") :]
            if text:
                self._on_text(text, out)
            if tag is not None and self._state != state:  # a tag of the state the text left
                self._buf = tag + self._buf
            elif tag is not None:
                self._on_tag(tag)

    def _on_text(self, text: str, out: list[Piece]) -> None:
        state = self._state
        if state == "before" or state == "content":
            self._emit("content", text, out)
        elif state == "opening":
            self._opening(text)
        elif state == "first":
            self._state = "reasoning"
            self._emit("reasoning", text.removeprefix("\n"), out)
        elif state == "reasoning":
            self._emit("reasoning", text, out)
        else:  # "after"
            rest = text.lstrip("\n")
            if rest:
                self._state = "content"
                self._emit("content", rest, out)

    def _opening(self, text: str) -> None:
        """Drop the opening tag if the output starts with it; otherwise read it as reasoning."""
        seen = self._acc + text
        if self.start.startswith(seen) and seen != self.start:
            self._acc = seen  # could still be the tag
            return
        self._acc = ""
        if seen.startswith(self.start):
            self._state = "first"
            self._buf = seen[len(self.start) :] + self._buf
        else:
            self._state = "reasoning"
            self._buf = seen + self._buf

    def _on_tag(self, tag: str) -> None:
        if self._state == "before":
            self._state, self.opened = "first", True
        else:  # the closing tag (with the "\n" before it, when there is one)
            self._state = "after"

    @staticmethod
    def _emit(kind: str, text: str, out: list[Piece]) -> None:
        if text:
            out.append((kind, text))


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one kind as one piece (fewer, larger stream deltas)."""
    out: list[Piece] = []
    for kind, text in pieces:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 hybrid models: the output opens the block itself (or has none when thinking is
    off, the template having rendered an empty block into the prompt)."""

    def __init__(
        self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False
    ) -> None:
        super().__init__(start, end, starts_in_reasoning)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and templates ending the prompt with "<think>\\n"): the output starts in
    the block."""

    def __init__(
        self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = True
    ) -> None:
        super().__init__(start, end, starts_in_reasoning)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    return lookup(REASONING_PARSERS, name, "reasoning parser")

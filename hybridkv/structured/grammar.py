"""Grammar compilation and per-request matchers, on llguidance.

Why llguidance (benchmarks/structured_mask.py has the numbers): it has no Python dependency at
all (xgrammar imports `transformers` when it is imported and pulls it and triton in through
its package requirements), builds its tokenizer view straight from tokenizer.json, compiles a
schema in ~1 ms, and its matchers report errors as state instead of raising mid-decode.

The library is imported lazily (in GrammarCompiler) so that importing hybridkv.structured, e.g.
for the bitmask helpers, costs nothing for servers that never see a constrained request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from hybridkv.structured.bitmask import bitmask_words

if TYPE_CHECKING:
    from hybridkv.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# JSON output is compact: no whitespace between tokens and "," / ":" separators, as
# json.dumps(separators=(",", ":")) writes it. Why: a small or random model given free
# whitespace can emit spaces or newlines forever and never close the object; compact output is
# also fewer tokens. Whitespace inside string values is unaffected.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}

_MAX_ERROR_CHARS = 300


def _one_line(message: str) -> str:
    """Library errors come with multi-line carets and grammar echoes; ValueError messages go
    back to API clients on one line."""
    text = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; hashable, so it is the compile-cache key.

    kind / source:
      json_schema: source is the schema as JSON text. Serialise it WITHOUT sort_keys
        (json.dumps(schema, separators=(",", ":")) is a good canonical form): the output's
        properties come in the schema's `properties` order, so sorting keys reorders the
        output. Schemas compile as given (no OpenAI "strict" rewriting): a property not in
        `required` may be left out, and an object without "additionalProperties": false may
        get extra keys. A server that wants OpenAI strict semantics checks or rewrites the
        schema before building the spec.
      json_object: source is "" (any JSON object; OpenAI response_format json_object).
      regex: source is the pattern (Rust `regex` syntax, matched against the whole output).
      choice: source is a JSON list of strings; the output is exactly one of them.
      grammar: Lark text in llguidance's dialect (the start rule is `start`), or llama.cpp
        GBNF (recognised by `::=`, start rule `root`), which is converted to Lark.
    """

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r} (expected one of {_KINDS})")
        if not isinstance(self.source, str):
            raise ValueError(f"grammar source must be a str, got {type(self.source).__name__}")


def _to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text for a spec; ValueError for sources that are not even
    well-formed (the grammar itself is checked when the matcher is built)."""
    import llguidance

    matcher_cls = llguidance.LLMatcher
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema must be a JSON object")
        return matcher_cls.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return matcher_cls.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher_cls.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"choice is not a JSON list: {exc}") from None
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) for c in choices)
        ):
            raise ValueError("choice must be a non-empty JSON list of strings")
        # Lark string literals take JSON escapes, so json.dumps quotes any text safely.
        return matcher_cls.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(spec.source)
    except Exception as exc:  # the converter raises its own error types
        raise ValueError(f"invalid grammar: {_one_line(str(exc))}") from None
    return matcher_cls.grammar_from_lark(lark)


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: one owner (the engine thread).

    accept_token never puts the matcher in an error state: a disallowed token is refused and
    the state is left as it was, so a caller can sample again.
    """

    __slots__ = ("_m", "_eos", "_vocab_size", "_words")

    def __init__(self, matcher: Any, eos: frozenset[int], vocab_size: int) -> None:
        self._m = matcher
        self._eos = eos
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it.

        EOS is allowed where the grammar may end (and, idempotently, after termination)."""
        if not 0 <= token_id < self._vocab_size or self._m.is_error():
            return False
        if token_id in self._eos:
            if self._m.is_stopped():
                return True
            if not self._m.is_accepting():
                return False
            return bool(self._m.consume_token(token_id))
        # try_consume_tokens refuses a bad token without entering the error state that
        # consume_token would leave behind.
        return self._m.try_consume_tokens([token_id]) == 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, CPU, contiguous rows of
        ceil(vocab_size / 32) words). EOS is set only where the grammar may end; once
        terminated only EOS. Ids past the tokenizer (the model's padding) are never set.

        Costs ~10 us for most steps but up to ~1 ms at a step that starts a new JSON value with
        a 150k vocabulary (a walk of the token trie); the library drops the GIL meanwhile."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError("bitmask must be a 2-D int32 CPU tensor")
        if bitmask.shape[1] != self._words:
            raise ValueError(f"bitmask rows have {bitmask.shape[1]} words, expected {self._words}")
        target = bitmask[row]
        if not target.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        if self._m.is_error():
            # Only a resource limit gets here (accept_token never errs): end the request.
            target.zero_()
            for eos in self._eos:
                target[eos // 32] |= _bit(eos % 32)
            return
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)

    def draft_masks(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Speculative verification: the masks of a verify chunk's rows. Row j is the mask
        after drafts[:j]; the matcher advances through the drafts as far as the grammar allows
        (an EOS draft stops it: EOS ends a request, it never needs to be a draft) and is rolled
        back. Returns (bitmask [n + 1, words], n): n drafts the grammar allows in a row."""
        bitmask = torch.zeros((len(drafts) + 1, self._words), dtype=torch.int32)
        n = 0
        self.fill_bitmask(bitmask, 0)
        for token in drafts:
            if token in self._eos or not self.accept_token(token):
                break
            n += 1
            self.fill_bitmask(bitmask, n)
        if n:
            self._m.rollback(n)
        return bitmask[: n + 1], n

    def is_terminated(self) -> bool:
        """True once nothing but EOS can follow: the grammar is complete and cannot be
        extended, or EOS was accepted. (An integer like "12" may still grow, so it is not.)"""
        return bool(self._m.is_stopped())

    def error(self) -> str | None:
        """The library's message if the matcher hit a resource limit (grammar too complex)."""
        return _one_line(self._m.get_error()) if self._m.is_error() else None


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a (possibly negative) Python int torch accepts."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k


class CompiledGrammar:
    """A validated grammar in its initial state; shared by every request with the same spec.

    matcher() deep-copies a template matcher: ~1 us (the copy shares the compiled grammar and
    the lexer), against ~1 ms and more to build one from the grammar text, so only the first
    request with a spec pays for compilation."""

    def __init__(self, spec: GrammarSpec, template: Any, eos: frozenset[int], vocab_size: int):
        self.spec = spec
        self._template = template
        self._eos = eos
        self._vocab_size = vocab_size
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        # The lock keeps copies from several threads off the shared template at once.
        with self._lock:
            copy = self._template.deep_copy()
        return GrammarMatcher(copy, self._eos, self._vocab_size)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and logits width, with a thread-safe LRU cache.

    vocab_size is the logits width (the model's vocab_size), at least the tokenizer's size:
    bitmask rows are ceil(vocab_size / 32) words and ids past the tokenizer are always masked.
    eos_token_ids: every id that ends generation; the grammar allows them exactly where the
    output may end.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
    ) -> None:
        import llguidance

        tok_size = tokenizer.vocab_size
        if vocab_size < tok_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_size}")
        eos = sorted({int(e) for e in eos_token_ids})
        if not eos:
            raise ValueError("structured outputs need at least one EOS token id")
        if eos[0] < 0 or eos[-1] >= tok_size:
            raise ValueError(f"EOS token ids {eos} out of the tokenizer's range {tok_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self._eos = frozenset(eos)
        # The tokenizer.json text, with padding/truncation off as for any raw-token use.
        data = json.loads(tokenizer._tok.to_str())
        data["padding"] = None
        data["truncation"] = None
        try:
            self._lltok = llguidance.LLTokenizer(
                json.dumps(data), n_vocab=vocab_size, eos_token=eos
            )
        except Exception as exc:  # pyo3 raises ValueError/RuntimeError by case
            raise ValueError(
                f"llguidance cannot use this tokenizer: {_one_line(str(exc))}"
            ) from None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for spec, from the cache when it is there. Invalid schema,
        regex or grammar: ValueError with a one-line message. Thread-safe; two threads
        compiling the same new spec both work but get the same object back."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)  # outside the lock: llguidance drops the GIL here
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                return hit
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        try:
            grammar = _to_llguidance(spec)
        except ValueError as exc:
            raise ValueError(_one_line(str(exc))) from None
        template = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {spec.kind}: {_one_line(template.get_error())}")
        return CompiledGrammar(spec, template, self._eos, self.vocab_size)

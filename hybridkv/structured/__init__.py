"""Structured outputs: grammar-constrained decoding (OpenAI response_format json_object /
json_schema; vLLM-style guided_json, guided_regex, guided_choice, guided_grammar).

Flow per engine step: for each constrained request, `matcher.fill_bitmask(bitmask, row)`;
then `apply_bitmask(logits, bitmask, rows)`; sample; `matcher.accept_token(token)`.
The grammar library (llguidance) is imported only when a GrammarCompiler is built.
"""

from hybridkv.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_words
from hybridkv.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarKind,
    GrammarMatcher,
    GrammarSpec,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarKind",
    "GrammarMatcher",
    "GrammarSpec",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_words",
]

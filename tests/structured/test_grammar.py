"""hybridkv.structured against the default model's tokenizer.

The central check is a random walk: at each step a seeded RNG picks any token the bitmask
allows, the way a sampler over an untrained model would. Whatever path it takes, the text must
parse and satisfy the spec; if the mask ever allowed a token leading outside the language, or
never let the output end, some walk finds it.
"""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from hybridkv.structured import (
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
)
from hybridkv.tokenizer import Tokenizer
from tests.structured.schema_gen import random_schema

MODEL = Path(__file__).resolve().parents[2] / "hybridkv" / "default_model"
VOCAB = 4160  # logits wider than the 4096-token tokenizer, as a padded model vocabulary is
EOS = 0
MAX_STEPS = 400


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


@pytest.fixture(scope="module")
def closers(tokenizer: Tokenizer) -> np.ndarray:
    """Ids whose text closes something (a string, array or object): the walk leans on them
    as it gets long, so unbounded strings and arrays end well inside MAX_STEPS."""
    flags = np.zeros(VOCAB, dtype=bool)
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=False)
        flags[i] = any(c in text for c in '",]}')
    return flags


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> np.ndarray:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB])


def walk(
    matcher: GrammarMatcher, tokenizer: Tokenizer, closers: np.ndarray, seed: int
) -> tuple[str, int]:
    """Sample allowed tokens at random until the matcher terminates (EOS included)."""
    rng = random.Random(seed)
    bitmask = allocate_bitmask(1, VOCAB)
    out: list[int] = []
    for step in range(MAX_STEPS):
        matcher.fill_bitmask(bitmask, 0)
        ids = allowed_ids(bitmask)
        assert ids.size, f"no token allowed after {tokenizer.decode(out)!r}"
        assert ids.max() < tokenizer.vocab_size, "an id past the tokenizer was allowed"
        lean = 0.3 if step < 30 else 0.95
        if EOS in ids and rng.random() < lean:
            token = EOS
        else:
            closing = ids[closers[ids]]
            pool = closing if closing.size and rng.random() < lean else ids
            token = int(pool[rng.randrange(pool.size)])
        assert matcher.accept_token(token), f"allowed token {token} refused"
        if token == EOS:
            assert matcher.is_terminated()
            return tokenizer.decode(out), step + 1
        out.append(token)
    pytest.fail(f"no end after {MAX_STEPS} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(50))
def test_random_schema_walk(seed, compiler, tokenizer, closers):
    schema = random_schema(seed)
    spec = GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")))
    text, _ = walk(compiler.compile(spec).matcher(), tokenizer, closers, seed)
    jsonschema.validate(json.loads(text), schema)
    assert not whitespace_outside_strings(text), text


def whitespace_outside_strings(text: str) -> bool:
    """JSON output is compact: whitespace may only appear inside string values."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def test_property_order_follows_the_schema(compiler, tokenizer, closers):
    """Properties come out in the schema's order: why specs must not be built with sort_keys."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    text, _ = walk(
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema))).matcher(),
        tokenizer,
        closers,
        0,
    )
    assert list(json.loads(text)) == ["zeta", "alpha"]


@pytest.mark.parametrize(
    "pattern", [r"[a-z]{2,5}", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?", r"\d+(\.\d{1,2})?"]
)
def test_regex_walk(pattern, compiler, tokenizer, closers):
    for seed in range(3):
        text, _ = walk(
            compiler.compile(GrammarSpec("regex", pattern)).matcher(), tokenizer, closers, seed
        )
        assert re.fullmatch(pattern, text), (pattern, text)


def test_choice_walk(compiler, tokenizer, closers):
    choices = ["red", "green", "blue", "light blue", 'say "hi"\n', "é"]
    spec = GrammarSpec("choice", json.dumps(choices))
    seen = set()
    for seed in range(12):
        text, _ = walk(compiler.compile(spec).matcher(), tokenizer, closers, seed)
        assert text in choices
        seen.add(text)
    assert len(seen) > 1


def test_json_object_walk(compiler, tokenizer, closers):
    for seed in range(5):
        text, _ = walk(
            compiler.compile(GrammarSpec("json_object", "")).matcher(), tokenizer, closers, seed
        )
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "grammar",
    [
        'start: item ("," item)*\nitem: /[a-c]{1,3}/ | NUMBER\nNUMBER: /[0-9]+/',
        'root ::= item ("," item)*\nitem ::= [a-c] [a-c]? [a-c]? | [0-9]+',  # GBNF
    ],
)
def test_grammar_walk(grammar, compiler, tokenizer, closers):
    for seed in range(4):
        text, _ = walk(
            compiler.compile(GrammarSpec("grammar", grammar)).matcher(), tokenizer, closers, seed
        )
        assert re.fullmatch(r"([a-c]{1,3}|[0-9]+)(,([a-c]{1,3}|[0-9]+))*", text), text


@pytest.mark.parametrize(
    ("kind", "source", "needle"),
    [
        ("json_schema", '{"type":"foo"}', "foo"),
        ("json_schema", '{"type":', "JSON"),
        ("json_schema", "[1,2]", "object"),
        ("json_schema", '{"type":"string","pattern":"[a-"}', "regex"),
        ("regex", "[a-", "regex"),
        ("regex", "(ab", "regex"),
        ("grammar", "start: foo", "foo"),
        ("grammar", "root ::= (", "grammar"),
        ("choice", "[]", "choice"),
        ("choice", "[1, 2]", "choice"),
        ("choice", "red", "choice"),
    ],
)
def test_invalid_specs_raise_one_line_value_error(kind, source, needle, compiler):
    with pytest.raises(ValueError) as info:
        compiler.compile(GrammarSpec(kind, source))
    message = str(info.value)
    assert "\n" not in message and len(message) <= 300
    assert needle.lower() in message.lower(), message


def test_bad_spec_kind():
    with pytest.raises(ValueError):
        GrammarSpec("xml", "")  # type: ignore[arg-type]


def test_compile_cache_returns_the_same_object(compiler):
    spec = GrammarSpec("regex", "[a-z]+")
    first = compiler.compile(spec)
    assert compiler.compile(GrammarSpec("regex", "[a-z]+")) is first
    assert compiler.compile(GrammarSpec("regex", "[a-y]+")) is not first
    # Matchers from one compiled grammar are independent.
    a, b = first.matcher(), first.matcher()
    assert a.accept_token(65)  # "a"
    bitmask = allocate_bitmask(2, VOCAB)
    a.fill_bitmask(bitmask, 0)
    b.fill_bitmask(bitmask, 1)
    assert EOS in allowed_ids(bitmask, 0) and EOS not in allowed_ids(bitmask, 1)


def test_compile_is_thread_safe(tokenizer):
    fresh = GrammarCompiler(tokenizer, VOCAB, [EOS])
    spec = GrammarSpec("json_schema", json.dumps(random_schema(7)))
    results: list[object] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        results.append(fresh.compile(spec))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)


def test_cache_is_bounded(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_size=2)
    first = small.compile(GrammarSpec("regex", "a"))
    small.compile(GrammarSpec("regex", "b"))
    small.compile(GrammarSpec("regex", "c"))
    assert small.compile(GrammarSpec("regex", "a")) is not first


def test_refused_token_leaves_state_unchanged(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec("regex", "[0-9]{3}")).matcher()
    before = allocate_bitmask(1, VOCAB)
    after = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(before, 0)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not matcher.accept_token(letter)
    assert not matcher.accept_token(EOS)  # the grammar cannot end yet
    assert not matcher.accept_token(VOCAB - 1)  # padding id, past the tokenizer
    assert not matcher.accept_token(VOCAB + 5)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.error() is None
    for digit in tokenizer.encode("123", add_special_tokens=False):
        assert matcher.accept_token(digit)


def test_after_termination_only_eos(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec("choice", '["yes"]')).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert not matcher.is_terminated()
        assert matcher.accept_token(token)
    assert matcher.is_terminated()  # nothing can follow "yes"
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask).tolist() == [EOS]
    assert matcher.accept_token(EOS)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask).tolist() == [EOS]
    assert matcher.accept_token(EOS)  # idempotent
    assert not matcher.accept_token(tokenizer.encode("y", add_special_tokens=False)[0])


def test_eos_only_where_the_grammar_may_end(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec("json_schema", '{"type":"integer"}')).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert EOS not in allowed_ids(bitmask)
    for token in tokenizer.encode("12", add_special_tokens=False):
        assert matcher.accept_token(token)
    matcher.fill_bitmask(bitmask, 0)
    ids = allowed_ids(bitmask)
    assert EOS in ids and ids.size > 1  # may end, or take more digits
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()


def test_several_eos_ids(tokenizer):
    second = tokenizer.encode("&", add_special_tokens=False)[0]
    comp = GrammarCompiler(tokenizer, VOCAB, [EOS, second])
    matcher = comp.compile(GrammarSpec("regex", "ab")).matcher()
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert matcher.accept_token(token)
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask).tolist() == sorted([EOS, second])
    assert matcher.accept_token(second)


def test_compiler_arguments(tokenizer):
    with pytest.raises(ValueError, match="smaller"):
        GrammarCompiler(tokenizer, 100, [EOS])
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(tokenizer, VOCAB, [])
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(tokenizer, VOCAB, [5000])


def test_fill_bitmask_checks_the_tensor(compiler):
    matcher = compiler.compile(GrammarSpec("json_object", "")).matcher()
    with pytest.raises(ValueError):
        matcher.fill_bitmask(torch.zeros(1, 130, dtype=torch.int64), 0)
    with pytest.raises(ValueError):
        matcher.fill_bitmask(allocate_bitmask(1, 4096 + 64 * 32), 0)


def test_allocate_bitmask_shape():
    bm = allocate_bitmask(3, 4161)
    assert bm.shape == (3, 131) and bm.dtype == torch.int32 and not bm.any()


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    out = logits.clone()
    width = logits.shape[1]
    for r in range(logits.shape[0]) if rows is None else rows:
        bits = np.unpackbits(bitmask[r].numpy().view(np.uint8), bitorder="little")
        allowed = np.zeros(width, dtype=bool)
        allowed[: min(width, bits.size)] = bits[:width].astype(bool)
        out[r, torch.from_numpy(~allowed)] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [None, [2], [3, 0], []])
@pytest.mark.parametrize("width", [VOCAB, 4096, 4100, 70])
def test_apply_bitmask_exact(rows, width):
    gen = torch.Generator().manual_seed(width)
    words = (width + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[0, : words // 2 + 1] = 0  # a mostly-disallowed row
    bitmask[1, : words // 2 + 1] = -1  # a mostly-allowed row
    bitmask[2, :] = 0
    bitmask[2, words - 1] = 1 << 3
    logits = torch.randn(4, width, generator=gen)
    expected = reference_apply(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_apply_bitmask_masks_ids_past_the_tokenizer(compiler):
    """Real masks: every id past the tokenizer (4096..4159) and past a narrower bitmask is
    -inf, whatever the grammar."""
    matchers = [
        compiler.compile(GrammarSpec("json_object", "")).matcher(),
        compiler.compile(GrammarSpec("json_schema", '{"type":"string"}')).matcher(),
    ]
    matchers[1].accept_token(2)  # '"': inside a string nearly everything is allowed
    bitmask = allocate_bitmask(2, VOCAB)
    for row, m in enumerate(matchers):
        m.fill_bitmask(bitmask, row)
    logits = torch.zeros(2, VOCAB + 40)  # logits even wider than the bitmask
    expected = reference_apply(logits, bitmask, None)
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[:, 4096:]).all()
    assert torch.isfinite(logits[1, :4096]).sum() > 3000


def test_apply_bitmask_argument_checks():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError):
        apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        apply_bitmask(logits, allocate_bitmask(1, 64))
    with pytest.raises(ValueError):
        apply_bitmask(logits, allocate_bitmask(2, 64), rows=[2])

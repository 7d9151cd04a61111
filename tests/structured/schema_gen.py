"""A seeded random JSON-schema generator for the grammar tests.

Why: hand-written schemas test the cases we thought of; random nesting of the keywords that
OpenAI-style structured outputs use finds the combinations we did not. Every schema is closed
(all properties required, "additionalProperties": false), as OpenAI strict mode writes them.

Keywords generated (all compiled exactly by llguidance): type object / array / string /
integer / number / boolean, properties + required + additionalProperties false, items,
minItems / maxItems (small), enum (strings, numbers, null, booleans mixed), minimum / maximum
on integers and numbers, multipleOf 0.5 or 0.25 on numbers, string pattern (anchored, simple
classes and counts) and maxLength.

Every value's text is bounded, as OpenAI strict schemas are in practice: strings have a
maxLength or a pattern, arrays a maxItems, integers a minimum and maximum, and numbers also a
multipleOf (a minimum and maximum bound the integer part only: "0.1234..." may go on forever).
Why: a model that knows no JSON (the tests' default model) sampled at temperature ~1 writes
digits or string characters until max_tokens for about one schema in 500 otherwise, and the
server tests want every output to end by itself. The multipleOf values are binary fractions
because both sides check them exactly: llguidance checks the decimal text (it refuses some
valid spellings, e.g. "2.5" for 0.25, so its outputs are a subset of the valid ones), and
jsonschema's float division x / 0.25 has no rounding error (x / 0.1 has: 0.7 / 0.1 fails).

Left out on purpose, because llguidance does not enforce them exactly or at all:
format (only some formats, e.g. date-time / email / uuid, are known), multipleOf on numbers
with decimal fractions (see above), uniqueItems, patternProperties, dependentRequired /
dependentSchemas, if / then / else, contains / minContains, not, and oneOf that is not
disjoint (compiled as anyOf). $ref / $defs and anyOf are supported but not generated here.
"""

from __future__ import annotations

import random
from typing import Any

PATTERNS = [
    "^[a-z]{2,5}$",
    "^[0-9]{3}-[0-9]{4}$",
    "^[A-Z][a-z]{1,6}$",
    "^(red|green|blue)$",
    "^[a-f0-9]{4}$",
    "^x[0-9]{1,3}y$",
]
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "zeta", "eta", "rho"]


def _scalar(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "pattern", "integer", "number", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        lo = rng.choice([-10.5, 0, 1, 2.25, -100])
        return {
            "type": "number",
            "minimum": lo,
            "maximum": lo + rng.choice([1, 10, 99.5, 1000]),
            "multipleOf": rng.choice([0.5, 0.25]),
        }
    if kind == "boolean":
        return {"type": "boolean"}
    pool: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
    if rng.random() < 0.3:
        pool += rng.sample([1, 2.5, None, True, False, -3], rng.randint(1, 2))
    return {"enum": pool}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    r = rng.random()
    if depth < 3 and r < 0.25:
        return random_object(rng, depth + 1)
    if depth < 3 and r < 0.45:
        lo = rng.randint(0, 2)
        return {
            "type": "array",
            "items": _node(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 3),
        }
    return _scalar(rng)


def random_object(rng: random.Random, depth: int = 1) -> dict[str, Any]:
    """A closed object schema: 1-5 required properties, nesting to depth 3."""
    names = rng.sample(
        ["id", "name", "kind", "count", "tags", "meta", "value", "ok", "items", "code", "score"],
        rng.randint(1, 5),
    )
    return {
        "type": "object",
        "properties": {name: _node(rng, depth) for name in names},
        "required": list(names),
        "additionalProperties": False,
    }


def random_schema(seed: int) -> dict[str, Any]:
    """The schema for one seed: always an object at the top, as response_format requires."""
    return random_object(random.Random(seed))

"""A seeded random JSON-schema generator for the grammar tests.

Why: hand-written schemas test the cases we thought of; random nesting of the keywords that
OpenAI-style structured outputs use finds the combinations we did not. Every schema is closed
(all properties required, "additionalProperties": false), as OpenAI strict mode writes them.

Keywords generated (all compiled exactly by llguidance): type object / array / string /
integer / number / boolean, properties + required + additionalProperties false, items,
minItems / maxItems (small), enum (strings, numbers, null, booleans mixed), minimum / maximum
on integers and numbers, string pattern (anchored, simple classes and counts) and maxLength.

Left out on purpose, because llguidance does not enforce them exactly or at all:
format (only some formats, e.g. date-time / email / uuid, are known), multipleOf on numbers
with fractions, uniqueItems, patternProperties, dependentRequired / dependentSchemas,
if / then / else, contains / minContains, not, and oneOf that is not disjoint (compiled as
anyOf). $ref / $defs and anyOf are supported but not generated here.
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
        schema: dict[str, Any] = {"type": "integer"}
        if rng.random() < 0.7:
            lo = rng.randint(-1000, 1000)
            schema["minimum"] = lo
            schema["maximum"] = lo + rng.randint(0, 5000)
        return schema
    if kind == "number":
        schema = {"type": "number"}
        if rng.random() < 0.7:
            lo = rng.choice([-10.5, 0, 1, 2.25, -100])
            schema["minimum"] = lo
            schema["maximum"] = lo + rng.choice([1, 10, 99.5, 1000])
        return schema
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

"""Prefix keys are the same in every process (a router elsewhere computes a replica's keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hybridkv.core.hashing import ROOT, extend_hashes, root_hash

TOKENS = list(range(1000, 1100))
CASES = [(), ("salt-α",), ("lora-7", 3, b"x")]
SCRIPT = """
import json
from hybridkv.core.hashing import extend_hashes
cases = [(), ("salt-\\u03b1",), ("lora-7", 3, b"x")]
print(json.dumps([extend_hashes([], list(range(1000, 1100)), 16, c) for c in cases]))
"""


def keys_in_subprocess(seed: str) -> list[list[int]]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_keys_equal_across_hash_seeds():
    here = [extend_hashes([], TOKENS, 16, c) for c in CASES]
    assert keys_in_subprocess("1") == here
    assert keys_in_subprocess("12345") == here


def test_extra_keys_change_every_key():
    plain, salted = (extend_hashes([], TOKENS, 16, c) for c in CASES[:2])
    assert len(plain) == 6 and not set(plain) & set(salted)
    assert root_hash() == ROOT and root_hash(("a",)) != root_hash(("b",))

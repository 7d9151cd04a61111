"""Op families declare implementations; a chain is chosen once per (device, dtype)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops import registry
from hybridkv.ops.registry import OpError, OpFamily, OpImpl

_ME = "tests.ops.test_registry"


def fast(x: torch.Tensor) -> str:
    return "fast"


def small(x: torch.Tensor) -> str:
    return "small"


def slow(x: torch.Tensor) -> str:
    return "slow"


def _family() -> OpFamily:
    return OpFamily(
        "demo",
        (
            OpImpl("small", f"{_ME}:small", frozenset({"cpu"}), needs=("avx2",), max_rows=4),
            OpImpl(
                "fast", f"{_ME}:fast", frozenset({"cpu"}), frozenset({"float32"}), needs=("avx512",)
            ),  # fmt: skip
            OpImpl("slow", f"{_ME}:slow"),
        ),
    )


def test_choose_takes_declared_order_until_an_unlimited_link() -> None:
    fam = _family()
    have = frozenset({"avx2", "avx512"})
    assert [i.name for i in fam.choose("cpu", "float32", have)] == ["small", "fast"]
    assert [i.name for i in fam.choose("cpu", "bfloat16", have)] == ["small", "slow"]
    assert [i.name for i in fam.choose("cpu", "float32", frozenset())] == ["slow"]
    assert [i.name for i in fam.choose("cuda", "float32", have)] == ["slow"]


def test_none_runs_names_every_reason() -> None:
    fam = OpFamily("only", (OpImpl("x", f"{_ME}:fast", frozenset({"cpu"}), needs=("amx_bf16",)),))
    with pytest.raises(OpError, match=r"only .* x needs amx_bf16"):
        fam.choose("cpu", "float32", frozenset())
    with pytest.raises(OpError, match="runs on cpu, not cuda"):
        fam.choose("cuda", "float32", frozenset({"amx_bf16"}))


def test_chain_runs_the_link_for_the_rows(monkeypatch) -> None:
    monkeypatch.setattr(registry, "capabilities", lambda device: frozenset({"avx2", "avx512"}))
    fam = _family()
    chain = fam.of(torch.zeros(3, 2))
    assert chain.describe() == "small (rows <= 4), fast"
    assert chain.for_rows(1)(None) == "small" and chain.for_rows(4)(None) == "small"
    assert chain.for_rows(5)(None) == "fast"
    assert fam.of(torch.zeros(1)) is chain  # chosen once, then looked up


def test_a_float32_stream_mixed_with_the_model_dtype_takes_its_chain(monkeypatch) -> None:
    """x in float32 beside an input in the model's dtype (a float32 residual into a float16
    norm weight): the model dtype's chain, whose implementations take it; x's own dtype wins
    otherwise, and None inputs are skipped."""
    monkeypatch.setattr(registry, "capabilities", lambda device: frozenset({"avx512"}))
    fam = OpFamily(
        "mixed",
        (
            OpImpl("fast", f"{_ME}:fast", frozenset({"cpu"}), frozenset({"float32"}), ("avx512",)),
            OpImpl("slow", f"{_ME}:slow"),
        ),
    )
    x32, x16 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float16)
    assert fam.of(x32).describe() == "fast" and fam.of(x32, None, x32).describe() == "fast"
    assert fam.of(x32, None, x16).describe() == "slow"
    assert fam.of(x32, x16).dtype == "float16"
    assert fam.of(x16, x32).dtype == "float16"  # a non-float32 x keeps its own dtype


def test_a_family_must_end_with_an_unlimited_implementation() -> None:
    with pytest.raises(ValueError, match="any rows"):
        OpFamily("bad", (OpImpl("a", f"{_ME}:fast", max_rows=8),))
    with pytest.raises(ValueError, match="unique"):
        OpFamily("dup", (OpImpl("a", f"{_ME}:fast"), OpImpl("a", f"{_ME}:slow")))


def test_every_declared_family_has_a_chain_on_this_cpu() -> None:
    rows = registry.table("cpu", ["float32", "bfloat16", "float16"])  # float16: the engine takes it
    assert rows, "no op family declared"
    for name, dtype, text in rows:
        assert not text.startswith("none"), (name, dtype, text)
    with pytest.raises(KeyError, match="declared: "):
        registry.lookup("no_such_op")


def test_every_implementation_imports() -> None:
    registry._import_declaring()
    for family in registry.FAMILIES.values():
        for impl in family.impls:
            assert callable(impl.load()), impl


def test_the_engine_logs_the_cpu_line_and_its_op_table(caplog) -> None:
    import logging

    from hybridkv.engine import Engine
    from hybridkv.ops.native import cpu

    with caplog.at_level(logging.INFO, logger="hybridkv"):
        engine = Engine(None, max_model_len=256, max_num_seqs=2)
    assert {name for name, _, _ in engine.op_table} == set(registry.FAMILIES)
    assert all(not text.startswith("none") for _, _, text in engine.op_table)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert cpu.line() in logged and "rms_norm" in logged

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


def test_a_mixed_call_takes_a_chain_declared_for_every_input_dtype(monkeypatch) -> None:
    """Inputs in several dtypes (a float32 residual into a float16 norm weight): the chain of
    the mixed key, whose implementations are declared for all of them; None inputs skipped."""
    monkeypatch.setattr(registry, "capabilities", lambda device: frozenset({"avx512"}))
    floats = frozenset({"float32", "bfloat16"})
    fam = OpFamily(
        "mixed",
        (
            OpImpl("fast", f"{_ME}:fast", frozenset({"cpu"}), floats, ("avx512",)),
            OpImpl("slow", f"{_ME}:slow"),
        ),
    )
    x32, x16 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float16)
    b16 = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert fam.of(x32).describe() == "fast" and fam.of(x32, None, x32).describe() == "fast"
    assert fam.of(x32, b16).describe() == "fast" and fam.of(x32, b16).dtype == "bfloat16+float32"
    assert fam.of(x32, None, x16).describe() == "slow"
    assert fam.of(b16, x16).dtype == fam.of(x16, b16).dtype == "bfloat16+float16"
    assert fam.of(b16, x16).describe() == "slow"
    assert "takes bfloat16, float32, not float16+float32" in str(
        fam.impls[0].why_not("cpu", "float16+float32", frozenset({"avx512"}))
    )


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

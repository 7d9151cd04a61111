import pytest
import torch
from torch import nn

from hybridkv.layers.linear import (
    _OPS,
    PackedLinear,
    linear_dtypes,
    native_rows,
    prepack_available,
    prepack_dtypes,
    prepack_linears,
    small_linear,
)
from hybridkv.ops import registry
from hybridkv.ops.native import bf16_linear as native_bf16
from hybridkv.ops.native import f32_linear as native_f32

pytestmark = pytest.mark.skipif(not prepack_available(), reason="no oneDNN in this torch build")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24, bias=True)
        self.head = nn.Linear(24, 50, bias=False)
        self.tied = nn.Linear(16, 50, bias=False)
        self.tied.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.proj(h)) + self.tied(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_model_matches_and_keeps_names(dtype):
    torch.manual_seed(0)
    model = Tiny().to(dtype).eval()
    ids = torch.randint(0, 50, (7, 3))
    with torch.no_grad():
        before = model(ids).float()
    names = sorted(model.state_dict())
    if dtype not in linear_dtypes():  # bf16 without oneDNN bf16 nor the native kernel
        assert prepack_linears(model) == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        return
    assert prepack_linears(model) == 3
    assert all(isinstance(m, PackedLinear) for m in (model.proj, model.head, model.tied))
    assert sorted(model.state_dict()) == names
    assert model.tied.weight is model.emb.weight
    with torch.no_grad():
        after = model(ids).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(after, before, rtol=tol, atol=tol)


def test_refresh_after_weight_change():
    lin = nn.Linear(8, 4)
    packed = PackedLinear.from_linear(lin)
    with torch.no_grad():
        lin.weight.mul_(2)
    packed.refresh()
    x = torch.randn(3, 8)
    torch.testing.assert_close(packed(x), nn.functional.linear(x, lin.weight, lin.bias))


needs_bf16_kernel = pytest.mark.skipif(
    native_bf16.kernel() is None, reason="no native bf16 kernel (AVX2 or AVX512-BF16) here"
)


def _onednn(packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed linear, or F.linear where oneDNN cannot pack the dtype (bf16 on AVX2)."""
    flat = x.reshape(-1, packed.in_features)
    if packed.packed_weight is None:
        out = nn.functional.linear(flat, packed.weight, packed.bias)
    else:
        out = _OPS._linear_pointwise(flat, packed.packed_weight, packed.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], packed.out_features)


def test_native_rows_follow_onednn_and_the_build():
    """Where oneDNN packs the dtype the kernel runs up to its measured small_m() rows (the
    AVX-512 or the AVX2 value, by the CPU record); where it cannot (bfloat16 on AVX2) at every M;
    without a kernel never. A bfloat16 linear is swapped when either runs it."""
    for dtype, small in ((torch.float32, native_f32), (torch.bfloat16, native_bf16)):
        rows = native_rows(dtype)
        if small.kernel() is None:
            assert rows == 0
        elif dtype in prepack_dtypes():
            assert rows == small.small_m()
            assert small.small_m() in (small.SMALL_M, small.SMALL_M_AVX2)
        else:
            assert rows >= 2**31
        assert (dtype in linear_dtypes()) == (dtype in prepack_dtypes() or rows > 0)
    assert torch.float32 in prepack_dtypes()


@needs_bf16_kernel
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_small_batches_run_the_native_kernel(bias):
    """Up to native_rows rows a bfloat16 PackedLinear's output is the kernel's, bit for bit (2-D
    rows, strided rows and 3-D inputs); more rows, or autograd on, take oneDNN (F.linear where
    oneDNN has no bfloat16: AVX2, where the kernel takes every M, its GEMM past 20 rows)."""
    torch.manual_seed(0)
    lin = nn.Linear(100, 37, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    assert packed.small_kernel is not None
    assert (packed.packed_weight is None) == (torch.bfloat16 not in prepack_dtypes())
    rows = native_rows(torch.bfloat16)
    with torch.inference_mode():
        for m in [*range(1, min(rows, 40) + 2), 70]:
            wide = torch.randn(m, 107).to(torch.bfloat16)
            for x in (wide[:, :100].contiguous(), wide[:, 7:]):
                out = packed(x)
                if m <= rows:
                    assert torch.equal(out, native_bf16.bf16_linear(x, lin.weight, lin.bias))
                    assert torch.equal(out, small_linear(x, lin.weight, lin.bias))
                else:
                    assert torch.equal(out, _onednn(packed, x))
                torch.testing.assert_close(
                    out.float(), nn.functional.linear(x, lin.weight, lin.bias).float(),
                    rtol=2e-2, atol=2e-2,
                )  # fmt: skip
        x3 = torch.randn(2, 3, 100).to(torch.bfloat16)
        expect = native_bf16.bf16_linear(x3.reshape(6, 100), lin.weight, lin.bias)
        assert torch.equal(packed(x3), expect.reshape(2, 3, 37))
    x = torch.randn(2, 100).to(torch.bfloat16)
    with torch.enable_grad():
        assert torch.equal(packed(x), _onednn(packed, x))


@needs_bf16_kernel
def test_float32_and_disabled_native_keep_onednn(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    assert packed.small_kernel is None
    x = torch.randn(3, 16).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), _onednn(packed, x))


def test_choices_take_the_record_again_after_native_was_off(monkeypatch):
    """A CPU record first taken while HYBRIDKV_NATIVE=0 (no library: nothing built) is taken
    again by the linears' choices once the library is there, so that an AVX-512 build is not
    taken for a build without AVX-512 (small_m, native_limits)."""
    from hybridkv.layers import quantization as quant
    from hybridkv.ops import native
    from hybridkv.ops.native import cpu
    from hybridkv.ops.native.small_linear import SmallBatchLinear, loaded_record

    if native.library() is None:
        pytest.skip("no native library here")
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    cpu.record.cache_clear()
    assert not cpu.record().native_loaded
    monkeypatch.delenv("HYBRIDKV_NATIVE")
    assert loaded_record().native_loaded and cpu.record().native_loaded
    wide = "avx512" in cpu.record().usable
    probe = SmallBatchLinear(torch.float32, "hkv_f32_linear", "hkv_f32_linear_fast", ("avx512",))
    assert probe.wide() == wide
    cpu.record.cache_clear()
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    cpu.record()  # (recorded without the library again)
    monkeypatch.delenv("HYBRIDKV_NATIVE")
    limits = quant.native_limits()
    from hybridkv.ops.native import int8_linear

    avx2_kernel = int8_linear.kernel() is not None and not wide
    assert (limits[0] >= 2**31) == avx2_kernel

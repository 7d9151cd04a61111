"""int8 weight-only quantization of the model's linears (`LLM(..., quantization="int8")`).

After the weights are loaded (and before the CPU linears are pre-packed), every `nn.Linear`
worth it becomes an `Int8Linear`: weight int8 [out, in] with one symmetric scale per output
row, computed from the loaded float weight,

    scale[n] = max_k |w[n, k]| / 127      (rounded to bfloat16: the kernel's scale dtype)
    q[n, k]  = clamp(round(w[n, k] / scale[n]), -127, 127)
    w[n, k] ~ q[n, k] * scale[n]          (a zero row: scale 1, q 0)

and the float weight is freed. Biases stay float (the model's dtype). What stays float:
embeddings (a lookup), norms, convolutions, the state parameters (A_log, D, dt_bias), routers
and gates that choose experts (llama.cpp's quantizer keeps `ffn_gate_inp` float too: a flipped
expert choice costs more than the bytes saved), and the linears whose module reads `.weight`
itself instead of calling the layer (Mamba1's `dt_proj`, MLA's `kv_b_proj`). The lm_head is
quantized (llama.cpp's Q8_0 quantizes the output matrix too); with tied embeddings the
embedding keeps its float weight for the lookup and the head gets its own int8 copy.
docs/quantization.md has the measured accuracy, memory and speed.

The matmul, `x [M, K] -> [M, N]` (measured on the development CPU, Zen 5, one thread, for
hidden-size 768 shapes and the 32000-row lm_head: benchmarks/quantization.py):

    native kernel  `hybridkv/ops/native/int8_linear.c` (AVX-512): the int8 weights widened in
                   registers and reused for up to 4 rows of x, float32 sums, the row's scale
                   applied once, one rounding to x's dtype. float32 x: float32 FMAs, exact
                   float32 math (the error is the int8 weight's alone), at every M: up to 16
                   rows the weight streams from memory at the pace of a plain read of its bytes
                   (M = 1; 2.5-4x the native float32 linear, benchmarks/README.md); up to
                   BF16_GEMM_M - 1 rows where oneDNN's bfloat16 GEMM is fast (below), else
                   DEQUANT_M - 1 (below, float32 chunks), 15-25% slower than the float32
                   layer at M = 64 (Zen 5). bfloat16 x (widened to
                   float32 once, exactly: the same tiles): up to M = SMALL_M rows, where it
                   beats the path below (decode of the 100m model at batch 1: +25%)
    AMX tiles      `hybridkv/ops/native/int8_amx.c` where the CPU record has amx_int8: float32
                   x of BF16_GEMM_M rows or more, bfloat16 x above SMALL_M. The tiles read q as
                   it lies (AMX's A operand: 16 weight rows of 64 bytes; nothing widened, no
                   other copy) and each row of x as two 8-bit digits of its own scale (w8a8's
                   rounding, and the rest rounded again): x = sx (d1 + d2 / 254) + e, |e| <=
                   max |x[m, :]| / 64516 (2^-16 of the row's largest value; rounding x to
                   bfloat16, as the GEMM below, moves each value by up to 2^-9 of itself), exact
                   int32 sums of each digit (tdpbssd), y = (C2 / 254 + C1) sx scale in float32,
                   rounded once to x's dtype. Intel Xeon, 2 cores, AVX-512 + AMX, one thread,
                   768 -> 3072, us (minima): 135 / 328 / 1957 / 6807 at M = 16 / 64 / 512 /
                   1700; the bfloat16 layer's oneDNN GEMM on its prepacked weight 224 / 310 /
                   1523 / 5230, the GEMM below 784 / 1016 / 2978 / 9298, the float32 tiles at 16
                   rows 650. (Widening q to bfloat16 tiles for tdpbf16ps instead: 291 / 468 /
                   2207 / 9464, the widening about 4.5 cycles per 32 weights.) Prefill rows stay
                   1.2-1.5x the bfloat16 layer (benchmarks/README.md, int8)
    bfloat16 GEMM  float32 x of BF16_GEMM_M rows or more where oneDNN runs bfloat16
                   GEMMs fast and the tiles above do not run (AVX512-BF16 without AMX, the
                   CPU record's "oneDNN bf16" without amx_int8): x rounded to
                   bfloat16, q converted to bfloat16 in blocks (exact), oneDNN's GEMM, the
                   output (rounded to bfloat16, as the bfloat16 layer's) scaled per column.
                   The one place an int8 layer of a float32 model leaves float32 math: on
                   compute-bound prefill rows float32 FMAs ran at a third of the bfloat16
                   layer's pace (768 -> 3224, M = 512: 9.6 ms against 1.2 ms, 1.8 ms this way;
                   at M = 64 1.46 ms against 0.36, 0.65 this way; llama.cpp's Q8_0 rounds
                   activations to 8 bits there).
    float32 chunks float32 x of DEQUANT_M rows or more elsewhere (prefill): q converted to float32
                   in chunks of DEQUANT_ELEMENTS weights (exact), one float32 GEMM per chunk,
                   the output scaled per column: float32 math as above, on PyTorch's GEMM.
                   1.1-1.5x the native tiles at M = 128-1024 (Xeon, 1 and 2 threads; within
                   1.06-1.3x of the float32 layer), which still win at M = 64
    PyTorch        bfloat16 x above SMALL_M rows without AMX, or no native kernel
                   (`HYBRIDKV_NATIVE=0`, no compiler, no AVX2): in bfloat16 with float32
                   accumulation (a float32 input rounded to bfloat16, the output cast back):
        M <= SMALL_M   torch.ops.aten._weight_int8pack_mm(x_bf16, q, scale_bf16): reads the
                   int8 weight once per 4 rows of x (AVX-512; its float32 path is a scalar
                   loop, 10-50x slower); in_features must be a multiple of 16 (KERNEL_K),
                   else the GEMM path below
        M >  SMALL_M   dequantize-on-the-fly: q converted to bfloat16 in chunks of about
                   CHUNK_ELEMENTS weights (L2-sized), a bfloat16 GEMM per chunk, the output
                   scaled per column (the scale of an output row factors out of its dot
                   product, so the chunk is only cast, never multiplied); within 10-25% of
                   the bfloat16 layer at M = 64-512

AVX2 CPUs (no AVX-512; `native_limits()` decides once from the CPU record): the native kernel
at every M, for both dtypes of x: its 8-lane tiles (int8 widened to float32 in registers, as
above) up to 20 rows, above them the AVX2 GEMM of `f32_linear.c` (q converted to float32 a
block at a time, x copied into panels of 16 rows, the row's scale once per sum): the same
float32 math. PyTorch's paths are no alternative there: its bfloat16 GEMM runs 3-5x below
float32 on AVX2 (the kernel takes 0.17-0.22x its time at 24-64 rows), and the kernel takes
0.76-0.92x the float32 chunks' time at M = 128, 0.88-1.02x at 512 (x86-64-v3 build with
oneDNN and MKL capped at AVX2 on the development Xeon, 1 thread, benchmarks/README.md
"AVX2").

Tensor parallel: each rank quantizes its shard after loading it. A column-parallel shard holds
whole rows, so its scales are the full model's; a row-parallel one (its input dim split) holds
part of every row, so the ranks take the max of their row maxima (one all-reduce for all of
them): every rank's int8 weight is then exactly its slice of the single-process one.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.config import QUANTIZATIONS, check_quantization  # noqa: F401 (re-exported)
from hybridkv.distributed.layers import VocabParallelHead
from hybridkv.distributed.parallel import SINGLE, TensorParallel
from hybridkv.layers.linear import PackedLinear
from hybridkv.ops.registry import OpImpl, declare

SMALL_M = 16  # rows of x up to which the kernels beat dequantize + bfloat16 GEMM (AVX-512)
CHUNK_ELEMENTS = 1 << 20  # weights dequantized at once on the GEMM path (2 MiB of bfloat16)
DEQUANT_M = 128  # rows of float32 x from which float32 chunks + GEMM beat the tiles (AVX-512)
DEQUANT_ELEMENTS = 1 << 21  # weights converted at once there (8 MiB of float32)
BF16_GEMM_ELEMENTS = 1 << 22  # weights converted at once for a bfloat16 GEMM (8 MiB)
# rows of float32 x from which oneDNN's bfloat16 GEMM (AMX) beats the float32 tiles, where it
# is fast (768 -> 3224, 2 threads: tiles 343 / 501 / 720 us at M = 16 / 24 / 32, the GEMM
# 467 / 465 / 505 us)
BF16_GEMM_M = 24
# _weight_int8pack_mm's AVX-512 kernel steps over K by 16 with aligned loads of x (32 bytes)
# and of the weight rows: another K reads past the rows (wrong sums or a crash), so those
# layers (a tensor-parallel shard of 24 columns, say) take the GEMM path at every M
KERNEL_K, KERNEL_ALIGN = 16, 32
COMPUTE_DTYPE = torch.bfloat16
# Linears that stay float, by their attribute name (see the module docstring); a linear
# inside a module named `router` too (GraniteMoE's `router.layer`).
QUANTIZE_LM_HEAD = True  # the engine's choice for the output projection (module docstring)
FLOAT_LINEARS = frozenset({"router", "gate", "shared_expert_gate", "dt_proj", "kv_b_proj"})
logger = logging.getLogger("hybridkv")


def row_absmax(w: torch.Tensor) -> torch.Tensor:
    """w [..., out, in] -> the largest |w| of every row, float32 [..., out]."""
    return w.detach().abs().amax(dim=-1).float()


def quantize_rows(
    w: torch.Tensor, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] float -> (q int8 [..., out, in], scale bfloat16 [..., out]), symmetric
    per output row. `absmax`: the rows' max |w| when it spans more than w (a row-parallel
    shard's full rows); default w's own."""
    amax = row_absmax(w) if absmax is None else absmax.float()
    # the bfloat16 scale is the one the kernel multiplies by, so q is rounded against it
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(COMPUTE_DTYPE)
    q = torch.round(w.detach().float() / scale.float()[..., None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q int8 [..., out, in], scale [..., out]) -> float32 [..., out, in]."""
    return q.float() * scale.float()[..., None]


def native_limits() -> tuple[int, int]:
    """(rows of bfloat16 x up to which `int8_matmul` runs the native kernel, rows of float32 x
    from which it leaves the kernel): SMALL_M, and BF16_GEMM_M where oneDNN runs bfloat16
    GEMMs fast (its GEMM from there) else DEQUANT_M (float32 chunks), read at the call; every
    M and never where the kernel is the AVX2 one (the module docstring: the build and the CPU
    decide, through the CPU record)."""
    from hybridkv.ops.native import int8_linear as native_int8
    from hybridkv.ops.native.small_linear import loaded_record

    record = loaded_record()
    if native_int8.kernel() is not None and not record.supports("avx512"):
        return sys.maxsize, sys.maxsize
    return SMALL_M, BF16_GEMM_M if record.onednn_bf16 else DEQUANT_M


# The int8 linear family, keyed by x's dtype (each implementation takes x [M, K], q, scale):
# on an AVX-512 Xeon with AMX (the CPU record's amx_int8)
#   float32   native-avx512 (rows < BF16_GEMM_M), native-amx-int8
#   bfloat16  native-avx512-bf16 (rows <= SMALL_M), native-amx-int8
# on one without
#   float32   native-avx512 (rows < BF16_GEMM_M), onednn-bf16-gemm, where oneDNN has fast
#             bfloat16 GEMMs (AVX512-BF16); else native-avx512 (rows < DEQUANT_M),
#             float32-chunks
#   bfloat16  native-avx512 (rows <= SMALL_M), torch-bf16
# on an AVX2 CPU the kernel at every M (`native_limits`); without the kernel float32 x takes
# _weight_int8pack_mm up to SMALL_M rows, then oneDNN's bfloat16 GEMM or the float32 chunks.
_CPU, _F32, _BF16 = frozenset({"cpu"}), frozenset({"float32"}), frozenset({"bfloat16"})
_HERE = f"{__name__}:"
INT8_LINEAR = declare(
    "int8_linear",
    (
        OpImpl("native-avx512", _HERE + "_native", _CPU, _F32, ("native", "avx512"),
               max_rows=lambda: native_limits()[1] - 1, description="int8_linear.c, 16 lanes"),
        OpImpl("native-avx512-bf16", _HERE + "_native", _CPU, _BF16, ("native", "avx512"),
               max_rows=lambda: SMALL_M, description="int8_linear.c, vdpbf16ps"),
        OpImpl("native-amx-int8", _HERE + "_native_amx", _CPU, _F32 | _BF16,
               ("native", "amx_int8"), description="int8_amx.c: q as tiles, x in 2 digits"),
        OpImpl("native-avx2", _HERE + "_native", _CPU, _F32 | _BF16, ("native", "avx2"),
               unless=("avx512",), description="int8_linear.c, 8 lanes: every M"),
        OpImpl("dequant-bf16", _HERE + "bf16_int8_matmul", _CPU, _F32,
               max_rows=lambda: SMALL_M, description="_weight_int8pack_mm, x as bf16"),
        OpImpl("onednn-bf16-gemm", _HERE + "bf16_gemm_int8_matmul", _CPU, _F32, ("onednn_bf16",),
               description="prefill rows: x and q as bfloat16, oneDNN's AMX / AVX512-BF16 GEMM"),
        OpImpl("float32-chunks", _HERE + "f32_int8_matmul", dtypes=_F32,
               description="q converted to float32 in chunks, one GEMM each"),
        OpImpl("torch-bf16", _HERE + "bf16_int8_matmul", description="dequantized bf16 GEMM"),
    ),
)  # fmt: skip


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, native_fits: bool | None = None
) -> torch.Tensor:
    """x [M, K] float, q int8 [N, K], scale bfloat16 [N] -> x @ (q * scale).T [M, N] in x's
    dtype: `INT8_LINEAR`'s link for x's rows (the module docstring).
    `native_fits`: `weights_fit(q, scale)`, if known (a weight the kernel cannot take runs
    the chain without the native links)."""
    from hybridkv.ops.native import int8_linear as native_int8

    if native_fits is None:
        native_fits = native_int8.weights_fit(q, scale)
    chain = INT8_LINEAR.chain(x.device, x.dtype, () if native_fits else ("native",))
    return chain.for_rows(x.shape[0])(x, q, scale)


def _native(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from hybridkv.ops.native import int8_linear as native_int8

    return native_int8.run(native_int8.kernel(), x, q, scale)


def _native_amx(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from hybridkv.ops.native import int8_linear as native_int8

    return native_int8.run_amx(x, q, scale)


def f32_int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` of float32 x in float32: q converted in chunks of output rows (exactly:
    |q| <= 127), a GEMM per chunk, each output column scaled once."""
    m, (n, k) = x.shape[0], q.shape
    rows = max(1, DEQUANT_ELEMENTS // max(k, 1))
    if rows >= n:
        out = torch.mm(x, q.to(torch.float32).T)
    else:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
        for start in range(0, n, rows):
            chunk = q[start : start + rows].to(torch.float32)  # [rows, K]
            torch.mm(x, chunk.T, out=out[:, start : start + rows])
    return out.mul_(scale.to(torch.float32))


def bf16_gemm_int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` of float32 x of many rows (prefill) on a CPU whose oneDNN has fast bfloat16
    GEMMs: x rounded to bfloat16, q converted to bfloat16 in blocks of BF16_GEMM_ELEMENTS
    weights (exact: |q| <= 127), one bfloat16 GEMM each (float32 sums, the output rounded to
    bfloat16 as the bfloat16 layer's is), scaled per column in float32. Compute-bound prefill
    runs at the bfloat16 layer's pace instead of float32 FMAs' (module docstring)."""
    xb = x.to(COMPUTE_DTYPE)
    m, (n, k) = xb.shape[0], q.shape
    rows = max(1, BF16_GEMM_ELEMENTS // max(k, 1))
    if rows >= n:
        out = F.linear(xb, q.to(COMPUTE_DTYPE)).to(torch.float32)
    else:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
        for start in range(0, n, rows):  # [M, rows] in bfloat16, widened into its columns
            out[:, start : start + rows] = F.linear(xb, q[start : start + rows].to(COMPUTE_DTYPE))
    return out.mul_(scale.to(torch.float32)).to(x.dtype)


def bf16_int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` on PyTorch's ops, in bfloat16 with float32 accumulation."""
    xb = x.to(COMPUTE_DTYPE).contiguous()
    m, (n, k) = xb.shape[0], q.shape
    if m <= SMALL_M and k % KERNEL_K == 0:
        if xb.data_ptr() % KERNEL_ALIGN:  # a view at an odd offset: the kernel's loads align
            xb = xb.clone()
        return torch.ops.aten._weight_int8pack_mm(xb, q, scale).to(x.dtype)
    rows = max(1, CHUNK_ELEMENTS // k)
    if rows >= n:
        out = F.linear(xb, q.to(COMPUTE_DTYPE))
    else:
        out = torch.empty(m, n, dtype=COMPUTE_DTYPE, device=x.device)
        for start in range(0, n, rows):
            chunk = q[start : start + rows].to(COMPUTE_DTYPE)  # [rows, K], exact (|q| <= 127)
            torch.mm(xb, chunk.T, out=out[:, start : start + rows])
    return out.to(x.dtype).mul_(scale.to(x.dtype))


class RowQuantizedLinear(nn.Module):
    """What the int8 and w8a8 layers share: [..., in] -> [..., out] through the subclass's
    `matmul` of [T, in] rows, then the float bias; and how each is made from a float linear."""

    in_features: int
    out_features: int
    bias: torch.nn.Parameter | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, absmax: torch.Tensor | None = None) -> Self:
        q, scale = quantize_rows(linear.weight, absmax)
        return cls(q, scale, linear.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype, without the bias."""
        raise NotImplementedError

    def stored_bytes(self) -> int:
        """Bytes of the int8 weight as stored (padding included) and of its scales."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; the engine's activations are [T, in] already
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self.matmul(flat)
        if self.bias is not None:
            out += self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


class QuantizedVocabHead:
    """Mixed into a quantized layer: `VocabParallelHead`'s rank rows, logits gathered."""

    def __init__(self, head: VocabParallelHead) -> None:
        q, scale = quantize_rows(head.weight)
        super().__init__(q, scale, head.bias)  # the quantized layer's
        self.tp, self.full_vocab = head.tp, head.full_vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> rank 0: [n, vocab]; other ranks: their [n, rows]
        return self.tp.gather_last_dim(super().forward(x), self.full_vocab)


class Int8Linear(RowQuantizedLinear):
    """A linear layer with an int8 weight [out, in] and per-output-row scales; the bias (if
    any) stays in the model's dtype. Buffers, so `.to(device)` moves them; not persistent:
    no checkpoint holds them."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.nn.Parameter | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = bias
        from hybridkv.ops.native import int8_linear as native_int8

        self.native_fits = native_int8.weights_fit(qweight, scale)  # checked once

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by: q * scale [out, in]."""
        return dequantize_rows(self.qweight, self.scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.qweight, self.scale, self.native_fits)

    def stored_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8VocabParallelHead(QuantizedVocabHead, Int8Linear):
    """`VocabParallelHead` with an int8 weight: this rank's vocabulary rows, logits gathered."""


# --- w8a8: int8 weights and 8-bit activations --------------------------------------------------
#
# quantization="w8a8": the weights as above (the same q and scale), stored packed for AMX's B
# operand (`pack_w8a8`: no other copy is kept), and each row of x rounded to 8 bits at every
# call, symmetric per row (per token, as vLLM's and SGLang's CPU w8a8): a = max |x[m, :]|,
# xq = round-half-even(x * (127 / a)), sx = a / 127. The int8 products are summed exactly and
# y = (sum * sx[m]) * scale[n], rounded once to x's dtype. Faster than the weight-only layer at
# every M on AMX-INT8 (benchmarks/int8_activations.py), at the cost of the activations' 8-bit
# rounding (docs/quantization.md has the accuracy); llama.cpp's Q8_0 rounds activations too.
#   float32 / bfloat16   native-amx-int8 (w8a8_linear.c), native-avx512-vnni (the same file:
#                        a B tile row per 512-bit vpdpbusd), native-avx2 (8-bit
#                        products on 256-bit vectors), native-neon-dot / native-neon (aarch64:
#                        sdot, or 16-bit products), else the PyTorch reference below
#   float16              the PyTorch reference


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> the packed weight [N/16, K/64, 16, 16, 4] (zero-padded):

        packed[nb, kb, r, n, j] = q[16 nb + n, 64 kb + 4 r + j]

    one AMX B tile (16 rows r of 16 columns n x 4 consecutive k) per (nb, kb)."""
    from hybridkv.ops.native import w8a8_linear as native_w8a8

    n, k = q.shape
    nb, kb, *_ = native_w8a8.packed_shape(n, k)
    padded = torch.zeros(nb * 16, kb * 64, dtype=torch.int8)
    padded[:n, :k] = q
    return padded.view(nb, 16, kb, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def unpack_w8a8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_w8a8`'s inverse: int8 [n, k]."""
    nb, kb = packed.shape[:2]
    return packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 64)[:n, :k].contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (xq float32 [M, K] of integers in [-127, 127], sx float32 [M, 1]): the
    kernel's rounding (127 / a divided, not a reciprocal times 127; half to even). A row with
    an infinity or NaN: xq 0, sx NaN (its outputs NaN, the other rows' untouched)."""
    xf = x.float()
    finite = xf.isfinite().all(1, keepdim=True)
    a = torch.where(finite, xf.abs().amax(1, keepdim=True), torch.zeros(()))
    inv = torch.where(a > 0, torch.full_like(a, 127.0) / a, torch.zeros_like(a))
    sx = torch.where(finite, a / 127, torch.full_like(a, float("nan")))
    return torch.round(xf * inv).nan_to_num_(0.0).clamp_(-127, 127), sx


def w8a8_reference(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """x [M, k] float -> [M, n] in x's dtype: the native kernels' result bit for bit (the sums
    in float64, exact: |sum| <= 127^2 k), for CPUs where none runs (slow: use int8 there)."""
    xq, sx = quantize_activations(x)
    q = unpack_w8a8(packed, n, k)
    sums = (xq.double() @ q.double().T).float()
    return ((sums * sx) * scale.float()[None, :]).to(x.dtype)


def _w8a8_native(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    from hybridkv.ops.native import w8a8_linear as native_w8a8

    return native_w8a8.run(x, packed, scale, n, k)


def _w8a8_avx512_vnni(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    from hybridkv.ops.native import w8a8_linear as native_w8a8

    return native_w8a8.run(x, packed, scale, n, k, kernel="avx512_vnni")


def _w8a8_avx2(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    from hybridkv.ops.native import w8a8_linear as native_w8a8

    return native_w8a8.run(x, packed, scale, n, k, kernel="avx2")


def _w8a8_neon_dot(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    from hybridkv.ops.native import w8a8_linear as native_w8a8

    return native_w8a8.run(x, packed, scale, n, k, kernel="neon_dot")


def _w8a8_neon(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    from hybridkv.ops.native import w8a8_linear as native_w8a8

    return native_w8a8.run(x, packed, scale, n, k, kernel="neon")


_FLOATS = _F32 | _BF16
W8A8_LINEAR = declare(
    "w8a8_linear",
    (
        OpImpl("native-amx-int8", _HERE + "_w8a8_native", _CPU, _FLOATS, ("native", "amx_int8"),
               description="w8a8_linear.c: x rounded to int8 per row, AMX-INT8 tiles"),
        OpImpl("native-avx512-vnni", _HERE + "_w8a8_avx512_vnni", _CPU, _FLOATS,
               ("native", "avx512_vnni"),
               description="w8a8_linear.c: 16 columns' 4-byte dot products per vpdpbusd"),
        OpImpl("native-avx2", _HERE + "_w8a8_avx2", _CPU, _FLOATS, ("native", "avx2"),
               description="w8a8_linear.c: 8-bit products with vpmaddubsw / AVX-VNNI"),
        OpImpl("native-neon-dot", _HERE + "_w8a8_neon_dot", _CPU, _FLOATS,
               ("native", "neon_dot"),
               description="w8a8_linear.c: aarch64, 4-wide int8 dot products (sdot)"),
        OpImpl("native-neon", _HERE + "_w8a8_neon", _CPU, _FLOATS, ("native", "neon"),
               description="w8a8_linear.c: aarch64 without sdot, 16-bit products (smull)"),
        OpImpl("torch", _HERE + "w8a8_reference", _CPU, _FLOATS | {"float16"},
               description="the reference: float64 sums of the int8 products"),
    ),
)  # fmt: skip


class W8A8Linear(RowQuantizedLinear):
    """A linear layer of quantization="w8a8": the int8 weight packed (`pack_w8a8`) with its
    per-row scales; activations rounded to int8 per row at each call (the block above). The
    bias (if any) stays in the model's dtype; buffers, not persistent."""

    packed: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.nn.Parameter | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("packed", pack_w8a8(qweight), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = bias
        from hybridkv.ops.native import w8a8_linear as native_w8a8

        native_w8a8.check_weights(self.packed, scale, *qweight.shape)  # once, not per call

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight [out, in] (unpacked: a copy)."""
        return unpack_w8a8(self.packed, self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_rows(self.qweight, self.scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        run = W8A8_LINEAR.chain(x.device, x.dtype).for_rows(x.shape[0])
        return run(x, self.packed, self.scale, self.out_features, self.in_features)

    def stored_bytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * self.scale.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


class W8A8VocabParallelHead(QuantizedVocabHead, W8A8Linear):
    """`VocabParallelHead` with a w8a8 weight: this rank's vocabulary rows, logits gathered."""


@dataclass(frozen=True)
class QuantizationReport:
    """What `quantize_model` did: layers made int8, what they weighed before and after, what
    stayed float. `freed_bytes` < `float_bytes` where a weight is shared with a module that
    keeps it (a tied embedding)."""

    method: str
    quantized: tuple[str, ...]  # module names now int8
    kept_float: tuple[str, ...]  # linears left float (FLOAT_LINEARS; lm_head if asked)
    float_bytes: int  # the quantized layers' float weights
    int8_bytes: int  # their int8 weights and scales
    freed_bytes: int  # float weight bytes no module references any more

    def summary(self) -> str:
        mib = 2**20
        return (
            f"{self.method}: {len(self.quantized)} linears quantized, their weights "
            f"{self.float_bytes / mib:.1f} MiB -> {self.int8_bytes / mib:.1f} MiB "
            f"({self.freed_bytes / mib:.1f} MiB freed); {len(self.kept_float)} kept float"
        )


def _row_parallel(linear: nn.Module) -> bool:
    """True where this rank holds part of every row (its input dim split)."""
    spec = linear.__dict__.get("_tp_shards", {}).get("weight")
    return spec is not None and spec.dim == 1 and not spec.rank0_only


def _full_row_absmax(
    names: list[str], linears: dict[str, nn.Linear], tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """Row maxima of every row-parallel linear over all ranks (one MAX all-reduce)."""
    if tp.size == 1 or not names:
        return {}
    import torch.distributed as dist

    maxima = [row_absmax(linears[n].weight) for n in names]
    flat = torch.cat(maxima)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=tp.group)
    return dict(zip(names, flat.split([m.numel() for m in maxima]), strict=True))


def _keeps_float(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] in FLOAT_LINEARS or (len(parts) > 1 and parts[-2] == "router")


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def quantize_model(
    model: nn.Module,
    tp: TensorParallel = SINGLE,
    lm_head: bool | None = None,
    method: str = "int8",
) -> QuantizationReport:
    """Replace the linears of a loaded `model` by `Int8Linear`s (method "int8") or
    `W8A8Linear`s ("w8a8") in place (see the module docstring for which); `lm_head=False`
    keeps the output projection float (None: QUANTIZE_LM_HEAD, read at the call). Every
    tensor-parallel rank calls this in the same order (the row maxima are all-reduced)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization method must be one of {QUANTIZATIONS}, got {method!r}")
    layer, head = (W8A8Linear, W8A8VocabParallelHead) if method == "w8a8" else (
        Int8Linear, Int8VocabParallelHead)  # fmt: skip
    if lm_head is None:
        lm_head = QUANTIZE_LM_HEAD
    linears: dict[str, nn.Linear] = {}
    kept: list[str] = []
    for name, module in model.named_modules():
        if type(module) not in (nn.Linear, PackedLinear, VocabParallelHead):
            continue
        float_head = name == "lm_head" and not lm_head
        if _keeps_float(name) or float_head or not module.weight.is_floating_point():
            kept.append(name)
        else:
            linears[name] = module
    row_parallel = [n for n, m in linears.items() if _row_parallel(m)]
    absmax = _full_row_absmax(row_parallel, linears, tp)
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears.values())
    before = {_storage_key(m.weight) for m in linears.values()}
    int8_bytes = 0
    for name, linear in linears.items():
        if isinstance(linear, VocabParallelHead):
            new: RowQuantizedLinear = head(linear)
        else:
            new = layer.from_linear(linear, absmax.get(name))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
        int8_bytes += new.stored_bytes()
    still = {_storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    freed = sum(
        m.weight.numel() * m.weight.element_size()
        for m in linears.values()
        if _storage_key(m.weight) in before - still
    )
    report = QuantizationReport(method, tuple(linears), tuple(kept), float_bytes, int8_bytes, freed)
    logger.info("%s", report.summary())
    return report

"""Mamba2Mixer against the transformers mixers (pure-PyTorch path) with the same weights."""

import warnings

import pytest
import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.layers.mamba2 import Mamba2Mixer

HIDDEN, HEADS, STATE, GROUPS, CHUNK = 32, 4, 8, 2, 8


def bamba():
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

    cfg = BambaConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, mamba_n_heads=HEADS, mamba_d_state=STATE,
        mamba_n_groups=GROUPS, mamba_chunk_size=CHUNK, mamba_proj_bias=True,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, n_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head,
        d_state=cfg.mamba_d_state, n_groups=cfg.mamba_n_groups, d_conv=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias, norm_eps=cfg.rms_norm_eps, dt_limit=cfg.time_step_limit,
    )  # fmt: skip
    return BambaMixer(cfg, layer_idx=0), kwargs


def granite():
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMambaLayer,
    )

    cfg = GraniteMoeHybridConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, mamba_n_heads=HEADS, mamba_d_state=STATE,
        mamba_n_groups=1, mamba_chunk_size=CHUNK, mamba_conv_bias=False,
        time_step_limit=(0.0, 1.5), num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba"],
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, n_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head,
        d_state=cfg.mamba_d_state, n_groups=cfg.mamba_n_groups, d_conv=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias, norm_eps=cfg.rms_norm_eps, dt_limit=cfg.time_step_limit,
    )  # fmt: skip
    return GraniteMoeHybridMambaLayer(cfg, layer_idx=0), kwargs


def nemotron_h():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=HEADS, mamba_head_dim=12, ssm_state_size=STATE,
        n_groups=GROUPS, chunk_size=CHUNK, use_bias=True, time_step_limit=(0.6, 3.0),
        layers_block_type=["mamba"], num_hidden_layers=1,
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, n_heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim,
        d_state=cfg.ssm_state_size, n_groups=cfg.n_groups, d_conv=cfg.conv_kernel,
        chunk_size=cfg.chunk_size, conv_bias=cfg.use_conv_bias, proj_bias=cfg.use_bias,
        norm_eps=cfg.layer_norm_epsilon, dt_limit=cfg.time_step_limit,
    )  # fmt: skip
    return NemotronHMamba2Mixer(cfg, layer_idx=0), kwargs


def zamba2():
    from transformers import Zamba2Config
    from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

    cfg = Zamba2Config(
        hidden_size=HIDDEN, n_mamba_heads=HEADS, mamba_d_state=STATE, mamba_ngroups=GROUPS,
        chunk_size=CHUNK, num_hidden_layers=1, layers_block_type=["mamba"],
        num_attention_heads=4, time_step_min=0.3,
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, n_heads=cfg.n_mamba_heads, head_dim=cfg.mamba_headdim,
        d_state=cfg.mamba_d_state, n_groups=cfg.mamba_ngroups, d_conv=cfg.mamba_d_conv,
        chunk_size=cfg.chunk_size, conv_bias=True, proj_bias=cfg.add_bias_linear,
        norm_eps=1e-5, dt_limit=(cfg.time_step_min, float("inf")),
    )  # fmt: skip
    return Zamba2MambaMixer(cfg, layer_idx=0), kwargs


def falcon_h1(rms_norm: bool):
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    cfg = FalconH1Config(
        hidden_size=HIDDEN, num_hidden_layers=1, mamba_d_ssm=48, mamba_n_heads=HEADS,
        mamba_d_state=STATE, mamba_n_groups=GROUPS, mamba_chunk_size=CHUNK,
        mamba_rms_norm=rms_norm, projectors_bias=True, ssm_in_multiplier=0.8,
        ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9], num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    hf = FalconH1Mixer(cfg, layer_idx=0)
    hf.register_buffer("mup_vector", compute_mup_vector(cfg), persistent=False)
    kwargs = dict(
        hidden_size=cfg.hidden_size, n_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head,
        d_state=cfg.mamba_d_state, n_groups=cfg.mamba_n_groups, d_conv=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias, norm_eps=cfg.rms_norm_eps, dt_limit=cfg.time_step_limit,
        out_proj_bias=cfg.projectors_bias, gated_norm=cfg.mamba_rms_norm,
        norm_before_gate=cfg.mamba_norm_before_gate, norm_weight_in_fp32=True,
        in_multiplier=cfg.ssm_in_multiplier, proj_multipliers=cfg.ssm_multipliers,
    )  # fmt: skip
    return hf, kwargs


FAMILIES = {
    "bamba": bamba,
    "granitemoehybrid": granite,
    "nemotron_h": nemotron_h,
    "zamba2": zamba2,
    "falcon_h1": lambda: falcon_h1(rms_norm=False),
    "falcon_h1_rmsnorm": lambda: falcon_h1(rms_norm=True),
}


def build(family: str, seed: int = 0):
    """The transformers mixer with seeded random weights, and ours loaded from its state_dict."""
    torch.manual_seed(seed)
    hf, kwargs = FAMILIES[family]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name in ("A_log", "dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    ours = Mamba2Mixer(**kwargs)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf.eval(), ours.eval()


class Pages:
    """Conv and SSM state views into one float32 buffer (stride = page), filled with NaN."""

    def __init__(self, mixer: Mamba2Mixer, num_pages: int = 8):
        conv_n = mixer.conv_dim * (mixer.d_conv - 1)
        ssm_n = mixer.n_heads * mixer.head_dim * mixer.d_state
        self.buffer = torch.full((num_pages, conv_n + ssm_n + 3), float("nan"))
        self.conv = self.buffer[:, :conv_n].view(num_pages, mixer.conv_dim, mixer.d_conv - 1)
        self.ssm = self.buffer[:, conv_n : conv_n + ssm_n].view(
            num_pages, mixer.n_heads, mixer.head_dim, mixer.d_state
        )


def meta_for(lens, pages, has_init) -> StateMetadata:
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return StateMetadata(
        state_pages=torch.tensor(pages, dtype=torch.int64),
        has_initial_state=torch.tensor(has_init),
        query_start_loc=qsl,
        max_query_len=max(lens),
    )


def hf_outputs(hf, seqs):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return [hf(s[None])[0] for s in seqs]


def rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_matches_transformers(family, mamba2_ops):
    hf, ours = build(family)
    seqs = [torch.randn(n, HIDDEN) for n in (13, 5, 20)]  # one, partial and several chunks
    refs = hf_outputs(hf, seqs)
    pages = Pages(ours)
    with torch.no_grad():
        out = ours.mix(
            torch.cat(seqs),
            pages.conv,
            pages.ssm,
            meta_for([13, 5, 20], [6, 1, 3], [False] * 3),
            mamba2_ops,
        )
    assert not torch.isnan(out).any()
    assert rel_err(out, torch.cat(refs)) <= 1e-5  # measured 1e-7..6e-7
    assert torch.cat(refs).std() > 0.05  # outputs are not flat


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_and_decode_match_transformers(family, mamba2_ops):
    """Ragged steps (prefill chunks, mixed prefill+decode, pure decode) vs one full-length run."""
    hf, ours = build(family, seed=1)
    totals = {"a": 16, "b": 9, "c": 7}
    seqs = {k: torch.randn(n, HIDDEN) for k, n in totals.items()}
    refs = dict(zip(seqs, hf_outputs(hf, list(seqs.values())), strict=True))
    page_of = {"a": 5, "b": 0, "c": 2}
    steps = [  # request -> tokens this step
        {"a": 10, "b": 3},
        {"a": 1, "b": 4, "c": 5},  # decode mixed with prefill chunks
        {"a": 1, "b": 1, "c": 1},  # pure decode
        {"a": 1, "b": 1, "c": 1},
        {"a": 1},
        {"a": 1},
        {"a": 1},
    ]
    pages = Pages(ours)
    done = dict.fromkeys(totals, 0)
    outs = {k: [] for k in totals}
    for step in steps:
        names = list(step)
        x = torch.cat([seqs[k][done[k] : done[k] + step[k]] for k in names])
        meta = meta_for([step[k] for k in names], [page_of[k] for k in names],
                        [done[k] > 0 for k in names])  # fmt: skip
        with torch.no_grad():
            y = ours.mix(x, pages.conv, pages.ssm, meta, mamba2_ops)
        for k, part in zip(names, y.split([step[k] for k in names]), strict=True):
            outs[k].append(part)
            done[k] += step[k]
    assert done == totals
    for k in totals:
        assert rel_err(torch.cat(outs[k]), refs[k]) <= 1e-5, k


def test_bf16_weights_with_bf16_conv_and_fp32_ssm_pages():
    """Runs in bf16 (conv state bf16, SSM state fp32) and stays close to the fp32 result."""
    _, ours = build("nemotron_h")
    x = torch.randn(11, HIDDEN)
    meta = meta_for([7, 4], [1, 0], [False, False])
    pages = Pages(ours)
    with torch.no_grad():
        ref = ours.mix(x, pages.conv, pages.ssm, meta)
        ours_bf16 = ours.to(torch.bfloat16)
        conv = torch.full(pages.conv.shape, float("nan"), dtype=torch.bfloat16)
        ssm = torch.full(pages.ssm.shape, float("nan"))
        out = ours_bf16.mix(x.to(torch.bfloat16), conv, ssm, meta)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert rel_err(out.float(), ref) < 5e-2
    torch.testing.assert_close(ssm[[1, 0]], pages.ssm[[1, 0]], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["granitemoehybrid", "nemotron_h", "falcon_h1_rmsnorm"])
def test_fused_native_mixer_equals_the_native_ops_one_by_one(family, dtype, monkeypatch):
    """`NativeMamba2Ops.fused_mix` (one call: conv, dt, scan, gated norm) gives the numbers of
    the native ops run one at a time, through prefill chunks and decodes from NaN pages, with
    states of the model dtype; and the states it leaves are theirs."""
    from hybridkv.ops import native
    from hybridkv.ops.mamba2_ops import NativeMamba2Ops

    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    _, ours = build(family, seed=2)
    ours = ours.to(dtype)
    assert ours.fusable
    g = torch.Generator().manual_seed(4)
    steps = [([9, 4], [3, 1], [False, False]), ([1, 1], [3, 1], [True, True]),
             ([6, 1], [3, 1], [True, True])]  # fmt: skip

    def run(ops):
        conv = torch.full((5, ours.conv_dim, ours.d_conv - 1), float("nan"), dtype=dtype)
        ssm = torch.full((5, ours.n_heads, ours.head_dim, ours.d_state), float("nan"), dtype=dtype)
        outs = []
        with torch.no_grad():
            for lens, pages, has in steps:
                x = torch.randn(sum(lens), HIDDEN, generator=g.manual_seed(sum(lens))).to(dtype)
                outs.append(ours.mix(x, conv, ssm, meta_for(lens, pages, has), ops))
        return outs, conv[[3, 1]], ssm[[3, 1]]

    calls = []
    fused_mix = NativeMamba2Ops.fused_mix
    monkeypatch.setattr(NativeMamba2Ops, "fused_mix", lambda *a: calls.append(1) or fused_mix(*a))
    fused = run(NativeMamba2Ops())
    assert len(calls) == len(steps)
    monkeypatch.setattr(NativeMamba2Ops, "fused_mix", lambda *a: None)
    separate = run(NativeMamba2Ops())
    for a, b in zip(fused[0], separate[0], strict=True):
        assert a.dtype == dtype and not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # (softplus: libm vs PyTorch)
    for a, b in zip(fused[1:], separate[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["granitemoehybrid", "nemotron_h"])
def test_native_mixer_keeps_the_state_after_every_position(family, dtype, fused, monkeypatch):
    """Speculative decoding's per-position states (`keeps_positions`): a verify step with
    scratch rows writes, for each of a request's tokens but its last, the state a chunk ending
    at that token leaves in its page (conv: exactly its last inputs; ssm: the same token-by-token
    numbers), changes neither the outputs nor the pages, and leaves rows -1 untouched. Chunks
    of 9 tokens too (the blocked scan is not taken for them)."""
    from hybridkv.ops import native
    from hybridkv.ops.mamba2_ops import NativeMamba2Ops, TorchMamba2Ops

    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    assert NativeMamba2Ops.keeps_positions and TorchMamba2Ops.keeps_positions
    if not fused:
        monkeypatch.setattr(NativeMamba2Ops, "fused_mix", lambda *a: None)
    _, ours = build(family, seed=3)
    ours = ours.to(dtype)
    ops = NativeMamba2Ops()
    g = torch.Generator().manual_seed(5)
    num_pages, depth = 6, 8
    conv0 = torch.randn(num_pages, ours.conv_dim, ours.d_conv - 1, generator=g).to(dtype)
    ssm0 = torch.randn(num_pages, ours.n_heads, ours.head_dim, ours.d_state, generator=g)
    ssm0 = (0.3 * ssm0).to(dtype)
    lens, pages, rows = [5, 1, 9, 4], [2, 0, 4, 5], [1, -1, 0, -1]
    x = torch.randn(sum(lens), HIDDEN, generator=g).to(dtype)

    def step(tokens, lens, pages, scratch_rows=None, positions=None):
        conv, ssm = conv0.clone(), ssm0.clone()
        meta = meta_for(lens, pages, [True] * len(lens))
        if scratch_rows is not None:
            meta = StateMetadata(**{**meta.__dict__, "scratch_rows": torch.tensor(scratch_rows)})
        with torch.no_grad():
            out = ours.mix(tokens, conv, ssm, meta, ops, positions)
        return out, conv, ssm

    kept = (
        torch.full((2, depth, *conv0.shape[1:]), float("nan"), dtype=dtype),
        torch.full((2, depth, *ssm0.shape[1:]), float("nan"), dtype=dtype),
    )
    out, conv, ssm = step(x, lens, pages, rows, kept)
    plain_out, plain_conv, plain_ssm = step(x, lens, pages)
    first = [0, 5, 6, 15]
    # requests of fewer than 8 tokens take the same scan path with or without positions
    short_pages, short_tokens = [2, 0, 5], [*range(0, 6), *range(15, 19)]
    assert torch.equal(conv, plain_conv)
    assert torch.equal(ssm[short_pages], plain_ssm[short_pages])
    assert torch.equal(out[short_tokens], plain_out[short_tokens])
    torch.testing.assert_close(ssm, plain_ssm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, plain_out, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        projected = ours._project_in(x)  # the prefixes below run on the same projections
    for req, row in ((0, 1), (2, 0)):
        for i in range(lens[req] - 1):
            prefix = projected[first[req] : first[req] + i + 1]
            monkeypatch.setattr(ours, "_project_in", lambda _, prefix=prefix: prefix)
            _, ref_conv, ref_ssm = step(x[: i + 1], [i + 1], [pages[req]])
            page = pages[req]
            assert torch.equal(kept[0][row, i], ref_conv[page]), (req, i)
            if fused:  # one kernel: the same numbers bit for bit
                assert torch.equal(kept[1][row, i], ref_ssm[page]), (req, i)
            else:  # (dt's softplus is a PyTorch op whose rounding may depend on the size)
                torch.testing.assert_close(kept[1][row, i], ref_ssm[page], rtol=1e-5, atol=1e-6)
        assert kept[0][row, lens[req] - 1 :].isnan().all()  # the last token's is in the page
        assert kept[1][row, lens[req] - 1 :].isnan().all()

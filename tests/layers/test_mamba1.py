"""Mamba1Mixer against transformers' Mamba, FalconMamba and Jamba mixers (pure-PyTorch slow
paths) with the same weights: prefill, then chunks and decode steps continuing from the paged
state."""

from __future__ import annotations

import warnings

import pytest
import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.kv.plan import select_state_ops
from hybridkv.kv.specs import CacheDtypes, mamba1_state
from hybridkv.layers.mamba1 import MAMBA1_OPS, Mamba1Mixer
from hybridkv.ops import native, registry
from hybridkv.ops.mamba1_ops import NativeMamba1Ops, TorchMamba1Ops
from tests.layers.replay import recording_linears, replaying, with_scratch_rows

HIDDEN, DI, STATE, CONV, RANK = 16, 40, 8, 4, 3


def mamba():
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    cfg = MambaConfig(
        hidden_size=HIDDEN, intermediate_size=DI, state_size=STATE, conv_kernel=CONV,
        time_step_rank=RANK, use_bias=True, num_hidden_layers=1,
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, d_inner=cfg.intermediate_size, d_state=cfg.state_size,
        d_conv=cfg.conv_kernel, dt_rank=cfg.time_step_rank, conv_bias=cfg.use_conv_bias,
        proj_bias=cfg.use_bias, activation=cfg.hidden_act,
    )  # fmt: skip
    return MambaMixer(cfg, layer_idx=0), kwargs


def falcon_mamba():
    from transformers import FalconMambaConfig
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer

    cfg = FalconMambaConfig(
        hidden_size=HIDDEN, intermediate_size=DI, state_size=STATE, conv_kernel=CONV,
        time_step_rank=RANK, use_conv_bias=False, num_hidden_layers=1, mixer_rms_eps=1e-5,
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, d_inner=cfg.intermediate_size, d_state=cfg.state_size,
        d_conv=cfg.conv_kernel, dt_rank=cfg.time_step_rank, conv_bias=cfg.use_conv_bias,
        proj_bias=cfg.use_bias, dt_norms="falcon_mamba", norm_eps=cfg.mixer_rms_eps,
        activation=cfg.hidden_act,
    )  # fmt: skip
    # (its own weight init reads the norms before it creates them: every weight is set below)
    return FalconMambaMixer(cfg, layer_idx=0, initialize_mixer_weights=False), kwargs


def jamba():
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    cfg = JambaConfig(
        hidden_size=HIDDEN, mamba_expand=DI // HIDDEN + 1, mamba_d_state=STATE,
        mamba_d_conv=CONV, mamba_dt_rank=RANK, mamba_proj_bias=True, num_hidden_layers=1,
        rms_norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    kwargs = dict(
        hidden_size=cfg.hidden_size, d_inner=cfg.mamba_expand * cfg.hidden_size,
        d_state=cfg.mamba_d_state, d_conv=cfg.mamba_d_conv, dt_rank=cfg.mamba_dt_rank,
        conv_bias=cfg.mamba_conv_bias, proj_bias=cfg.mamba_proj_bias, dt_norms="jamba",
        norm_eps=cfg.rms_norm_eps, activation=cfg.hidden_act,
    )  # fmt: skip
    return JambaMambaMixer(cfg, layer_idx=0), kwargs


FAMILIES = {"mamba": mamba, "falcon_mamba": falcon_mamba, "jamba": jamba}


def build(family: str, seed: int = 0):
    """The transformers mixer with seeded random weights, and ours loaded from its state_dict."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, kwargs = FAMILIES[family]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name == "A_log":
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.2))
            elif name == "dt_proj.bias":
                p.copy_(0.5 * torch.randn_like(p) - 1.0)
            else:
                p.copy_(0.3 * torch.randn_like(p))
    ours = Mamba1Mixer(**kwargs)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf.eval(), ours.eval()


class Pages:
    """Conv and SSM state views into one buffer (stride = page), filled with NaN."""

    def __init__(self, mixer: Mamba1Mixer, num_pages: int = 8, dtype=torch.float32):
        conv_n = mixer.d_inner * (mixer.d_conv - 1)
        ssm_n = mixer.d_inner * mixer.d_state
        self.buffer = torch.full((num_pages, conv_n + ssm_n + 4), float("nan"), dtype=dtype)
        self.conv = self.buffer[:, :conv_n].view(num_pages, mixer.d_inner, mixer.d_conv - 1)
        self.ssm = self.buffer[:, conv_n : conv_n + ssm_n].view(
            num_pages, mixer.d_inner, mixer.d_state
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


@pytest.fixture(params=["native", "torch"])
def mamba1_ops(request, monkeypatch):
    """The ops a Mamba1 state group would run: the native kernels or the PyTorch reference."""
    if request.param == "torch":
        monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
        registry.reset_all()  # op choices follow the new setting
        return TorchMamba1Ops()
    if native.library() is None:
        pytest.skip("no native kernels on this machine")
    return NativeMamba1Ops()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_matches_transformers(family, mamba1_ops):
    hf, ours = build(family)
    seqs = [torch.randn(n, HIDDEN) for n in (9, 2, 14)]
    refs = hf_outputs(hf, seqs)
    pages = Pages(ours)
    with torch.no_grad():
        out = ours.mix(
            torch.cat(seqs), pages.conv, pages.ssm, meta_for([9, 2, 14], [6, 1, 3], [False] * 3),
            mamba1_ops,
        )  # fmt: skip
    assert not torch.isnan(out).any()
    assert rel_err(out, torch.cat(refs)) <= 1e-5
    assert torch.cat(refs).std() > 0.05  # outputs are not flat


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_and_decode_match_transformers(family, mamba1_ops):
    """Ragged steps (prefill chunks, mixed prefill + decode, pure decode) vs one full run."""
    hf, ours = build(family, seed=1)
    totals = {"a": 15, "b": 9, "c": 7}
    seqs = {k: torch.randn(n, HIDDEN) for k, n in totals.items()}
    refs = dict(zip(seqs, hf_outputs(hf, list(seqs.values())), strict=True))
    page_of = {"a": 5, "b": 0, "c": 2}
    steps = [  # request -> tokens this step
        {"a": 9, "b": 2},
        {"a": 1, "b": 4, "c": 5},  # decode mixed with prefill chunks
        {"a": 1, "b": 1, "c": 1},  # pure decode
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1},
        {"a": 2},
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
            y = ours.mix(x, pages.conv, pages.ssm, meta, mamba1_ops)
        for k, part in zip(names, y.split([step[k] for k in names]), strict=True):
            outs[k].append(part)
            done[k] += step[k]
    assert done == totals
    for k in totals:
        assert rel_err(torch.cat(outs[k]), refs[k]) <= 1e-5, k
    untouched = [p for p in range(8) if p not in page_of.values()]
    assert torch.isnan(pages.buffer[untouched]).all()


@pytest.mark.parametrize("ops", [TorchMamba1Ops, NativeMamba1Ops])
def test_bf16_mixer_with_bf16_pages(ops, monkeypatch):
    """bf16 weights, bf16 conv and SSM pages: close to the float32 result."""
    if ops is NativeMamba1Ops and native.library() is None:
        pytest.skip("no native kernels on this machine")
    _, ours = build("jamba", seed=2)
    x = torch.randn(13, HIDDEN)
    meta = meta_for([9, 4], [1, 0], [False, False])
    pages = Pages(ours)
    with torch.no_grad():
        ref = ours.mix(x, pages.conv, pages.ssm, meta)
        bf = Pages(ours, dtype=torch.bfloat16)
        out = ours.to(torch.bfloat16).mix(x.to(torch.bfloat16), bf.conv, bf.ssm, meta, ops())
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert rel_err(out.float(), ref) < 5e-2
    torch.testing.assert_close(bf.ssm[[1, 0]].float(), pages.ssm[[1, 0]], rtol=5e-2, atol=5e-2)


def test_declared_cache_and_ops():
    _, ours = build("mamba")
    dtypes = CacheDtypes(kv="bfloat16", conv="bfloat16", ssm="float32")
    spec = ours.cache_spec(dtypes)
    plan_only = mamba1_state(DI, STATE, CONV, "bfloat16", "float32")
    assert spec.kind == plan_only.kind == "mamba1"
    assert spec.tensors == plan_only.tensors
    assert spec.ops == MAMBA1_OPS
    caps = frozenset({"native", "triton"})
    assert select_state_ops(spec, "cpu", "float32", caps) == "native"
    assert select_state_ops(spec, "cpu", "bfloat16", caps) == "native"
    assert select_state_ops(spec, "cpu", "float16", caps) == "torch"
    assert select_state_ops(spec, "cpu", "float32", frozenset()) == "torch"
    assert select_state_ops(spec, "cuda", "bfloat16", caps) == "triton"
    assert select_state_ops(spec, "rocm", "float16", caps) == "triton"
    assert select_state_ops(spec, "cuda", "bfloat16", frozenset({"native"})) == "torch"


def test_bad_arguments():
    with pytest.raises(ValueError, match="dt_norms"):
        Mamba1Mixer(16, 32, 8, 4, 2, dt_norms="mamba2")
    with pytest.raises(ValueError, match="d_conv"):
        Mamba1Mixer(16, 32, 8, 1, 2)
    with pytest.raises(ValueError, match="activation"):
        Mamba1Mixer(16, 32, 8, 4, 2, activation="gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["jamba", "falcon_mamba"])
@torch.inference_mode()
def test_native_scan_keeps_the_state_after_every_position(family, dtype):
    """Speculative decoding's per-position states (`NativeMamba1Ops.keeps_positions`): with
    scratch rows the conv and the scan keep, after each of a request's tokens but its last, the
    states that running its tokens up to there leaves in its pages (the projections replayed
    from the full step); outputs and pages unchanged; rows -1 write nothing."""
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    assert NativeMamba1Ops.keeps_positions and TorchMamba1Ops.keeps_positions
    _, ours = build(family, seed=4)
    ours = ours.to(dtype)
    ops, g = NativeMamba1Ops(), torch.Generator().manual_seed(8)
    di, n, k = ours.d_inner, ours.d_state, ours.d_conv
    conv0 = torch.randn(4, di, k - 1, generator=g).to(dtype)
    ssm0 = (0.3 * torch.randn(4, di, n, generator=g)).to(dtype)
    lens, pages, rows = [4, 1, 5], [1, 0, 3], [1, -1, 0]
    x = torch.randn(sum(lens), HIDDEN, generator=g).to(dtype)

    def run(first, lens, pages, rows=None, kept=None):
        conv, ssm = conv0.clone(), ssm0.clone()
        step = meta_for(lens, pages, [True] * len(lens))
        if rows is not None:
            step = with_scratch_rows(step, rows)
        out = ours.mix(x[first : first + sum(lens)], conv, ssm, step, ops, kept)
        return out, conv, ssm

    (plain_out, plain_conv, plain_ssm), full = recording_linears(ours, lambda: run(0, lens, pages))
    kept = tuple(torch.full((2, 4, *t.shape[1:]), float("nan"), dtype=dtype) for t in (conv0, ssm0))
    out, conv, ssm = run(0, lens, pages, rows, kept)
    assert torch.equal(out, plain_out) and torch.equal(conv, plain_conv)
    assert torch.equal(ssm, plain_ssm)  # (token by token either way)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for req, first, row in ((0, 0, 1), (2, 5, 0)):
        refs = []
        for i in range(lens[req] - 1):
            with replaying(full, first, first + i + 1):  # the prefix's projections: the step's
                _, ref_conv, ref_ssm = run(first, [i + 1], [pages[req]])
            refs.append(ref_ssm[pages[req]])
            assert torch.equal(kept[0][row, i], ref_conv[pages[req]]), (req, i)
            torch.testing.assert_close(kept[1][row, i], ref_ssm[pages[req]], **tol)
        for i in range(len(refs)):  # each kept state is its own position's
            gaps = [(kept[1][row, i].float() - r.float()).abs().max() for r in refs]
            assert min(range(len(refs)), key=lambda j: gaps[j]) == i
        assert all(t[row, lens[req] - 1 :].isnan().all() for t in kept)

import pytest
import torch

from hybridkv.ops import native
from hybridkv.ops.native import elementwise as native_ew
from hybridkv.sampling_params import SamplingParams
from hybridkv.worker.sampler import Sampler, SamplingRow


def logits_with_edge_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=g)
    x[1, [3, 700]] = 50.0  # a tie: the first index wins
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 10], x[3, 20] = float("nan"), 1e30  # NaN beats everything, as in torch
    x[4, 999] = 1e30  # the last column
    x[5, :] = 7.0  # a constant row
    return x


def test_native_argmax_matches_torch_on_ties_nan_and_inf():
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    x = logits_with_edge_rows()
    assert torch.equal(native_ew.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(9, 1300)
    wide[:, 100:1100] = x
    view = wide[:, 100:1100]  # strided rows
    assert torch.equal(native_ew.argmax_rows(view), x.argmax(dim=-1))
    assert native_ew.argmax_rows(x.double()) is None


def test_greedy_rows_take_the_argmax_next_to_sampled_rows(kernels):
    x = logits_with_edge_rows()
    x[3, 10] = 0.0  # no NaN here: a sampled row would reject it
    params = [SamplingParams(temperature=0.0)] * 9
    params[6] = SamplingParams(temperature=0.8, seed=1)
    samples = Sampler()(x, [SamplingRow(p) for p in params])
    greedy = [s.token for i, s in enumerate(samples) if i != 6]
    expected = [int(t) for i, t in enumerate(x.argmax(dim=-1)) if i != 6]
    assert greedy == expected
    all_greedy = Sampler()(x, [SamplingRow(SamplingParams(temperature=0.0))] * 9)
    assert [s.token for s in all_greedy] == x.argmax(dim=-1).tolist()


def test_penalties_and_bias_follow_the_reference_formulas():
    """logit_bias, repetition / frequency / presence penalties on the processed logits, against
    a per-token loop of the formulas; rows without processing and the raw log-probs untouched."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, generator=g) * 3
    prompt_ids, out_ids = [1, 2, 2, 7], [7, 9, 9, 9, 30]
    p = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.7,
        frequency_penalty=0.5,
        presence_penalty=-0.3,
        logit_bias={4: 2.5, 49: -1.0},
        logprobs=2,
    )
    rows = [
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(p, None, out_ids, prompt_ids),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={5: 100})),
    ]
    raw = x.clone()
    processed = Sampler()._process(x, rows, None)
    assert torch.equal(x, raw)  # the raw logits are kept for the log-probs
    assert torch.equal(processed[0], x[0])
    want = x[1].clone()
    want[4] += 2.5
    want[49] -= 1.0
    for t in set(prompt_ids + out_ids):
        want[t] = want[t] / 1.7 if want[t] > 0 else want[t] * 1.7
    for t in set(out_ids):
        want[t] -= 0.5 * out_ids.count(t) - 0.3
    assert torch.allclose(processed[1], want, atol=1e-6)
    samples = Sampler()(x, rows)
    assert samples[2].token == 5
    assert samples[1].token == int(want.argmax())
    assert samples[1].logprob == pytest.approx(float(torch.log_softmax(x[1], -1)[samples[1].token]))


def test_min_p_keeps_tokens_within_the_ratio():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    from hybridkv.worker.sampler import _filter_min_p

    kept = _filter_min_p(x, torch.tensor([0.5])).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.3 >= 0.25 > 0.15

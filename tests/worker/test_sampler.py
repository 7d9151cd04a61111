import pytest
import torch

from hybridkv.ops import native
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
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(9, 1300)
    wide[:, 100:1100] = x
    view = wide[:, 100:1100]  # strided rows
    assert torch.equal(native.argmax_rows(view), x.argmax(dim=-1))
    assert native.argmax_rows(x.double()) is None


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

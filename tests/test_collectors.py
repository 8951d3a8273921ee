"""Collectors: histograms against numpy, growth with same-width bins, per-channel stats, devices."""

import numpy as np
import pytest
import torch

import calibrate.collectors as collectors
from calibrate.collectors import ChannelStatsCollector, HistogramCollector, MaxCollector
from model_zoo.errors import ConfigError


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _close_counts(ours, theirs, slack):
    """Equal totals; bins may differ by `slack` elements (float32 vs float64 boundary rounding)."""
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape
    assert ours.sum() == theirs.sum()
    assert np.abs(ours - theirs).sum() <= slack


def test_first_batch_matches_numpy_histogram_of_abs():
    x = _randn(64, 96)  # [T, C]
    c = HistogramCollector(bins=512)
    c.collect(x)
    a = x.abs().numpy().astype(np.float64).ravel()
    ref, ref_edges = np.histogram(a, bins=512, range=(0, a.max()))
    assert c.hist.dtype == torch.float64 and c.hist.shape == (512,)
    assert np.allclose(c.edges.numpy(), ref_edges, rtol=1e-6, atol=0)
    _close_counts(c.hist.numpy(), ref, slack=4)
    assert c.hist[-1] >= 1  # the max element lands in the last bin
    assert c.count == x.numel()


def test_larger_max_appends_bins_of_the_same_width():
    first = _randn(1000, seed=1)
    first = first / first.abs().max()  # max |x| = 1
    second = _randn(1000, seed=2)
    second = second * (3 / second.abs().max())  # a later, larger max: 3
    c = HistogramCollector(bins=256)
    c.collect(first)
    kept = c.hist.clone()
    width = float(c.edges[1])
    c.collect(second)
    assert float(c.edges[1]) == pytest.approx(width)  # width unchanged
    assert c.hist.numel() == 768  # ceil(3 / (1 / 256))
    assert c.edges[-1] >= 3.0
    assert c.hist.sum() == 2000
    both = np.concatenate([first.abs().numpy(), second.abs().numpy()]).astype(np.float64)
    ref, _ = np.histogram(both, bins=c.edges.numpy())
    _close_counts(c.hist.numpy(), ref, slack=6)
    # the first batch's counts sit unchanged under the second batch's
    assert torch.all(c.hist[:256] >= kept)


def test_smaller_later_batch_keeps_the_bins():
    c = HistogramCollector(bins=128)
    c.collect(torch.tensor([4.0, -2.0]))
    c.collect(torch.tensor([1.0, 0.5]))
    assert c.hist.numel() == 128 and c.hist.sum() == 4 and float(c.edges[-1]) == 4.0


def test_growth_past_max_bins_merges_pairs():
    first = _randn(1001, seed=10)
    first = first / first.abs().max()  # [1001], max |x| = 1
    c = HistogramCollector(bins=128, max_bins=256)
    c.collect(first)
    c.collect(torch.tensor([10.0, 9.5, -0.3]))
    # width 1/128 doubled until ceil(10 / width) <= 256: 8/128 -> 160 bins
    assert float(c.edges[1]) == pytest.approx(8 / 128)
    assert c.hist.numel() == 160
    assert c.hist.sum() == 1004
    values = np.concatenate([first.abs().double().numpy(), [10.0, 9.5, 0.3]])
    ref, _ = np.histogram(values, bins=c.edges.numpy())
    _close_counts(c.hist.numpy(), ref, slack=4)


def test_zero_batches_before_data_count_in_bin_zero():
    c = HistogramCollector(bins=128)
    c.collect(torch.zeros(10))
    assert c.hist.sum() == 10 and float(c.edges[-1]) == 0.0  # all zero so far: width 0
    c.collect(torch.tensor([1.0, 0.0]))
    assert c.hist[0] == 11 and c.hist.sum() == 12 and float(c.edges[-1]) == 1.0


def test_half_precision_and_3d_input():
    x = _randn(2, 8, 16, seed=3).to(torch.bfloat16)  # [B, T, C]
    c = HistogramCollector(bins=128)
    c.collect(x)
    assert c.hist.sum() == x.numel()
    assert float(c.edges[-1]) == float(x.float().abs().max())


def test_chunked_histc_matches_one_call(monkeypatch):
    x = _randn(5000, seed=4)
    whole = HistogramCollector(bins=300)
    whole.collect(x)
    monkeypatch.setattr(collectors, "_HISTC_CHUNK", 777)
    chunked = HistogramCollector(bins=300)
    chunked.collect(x)
    assert torch.equal(whole.hist, chunked.hist)


def test_reset_and_bad_input():
    c = HistogramCollector(bins=128)
    c.collect(torch.ones(3))
    c.reset()
    assert c.hist is None and c.edges is None and c.count == 0
    with pytest.raises(ConfigError, match="non-finite"):
        c.collect(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ConfigError, match="at least 128"):
        HistogramCollector(bins=100)


def test_max_collector_per_tensor_and_per_channel():
    a, b = _randn(10, 6, seed=5), _randn(7, 6, seed=6, scale=3)  # [T, C]
    both = torch.cat([a, b]).abs()  # [17, C]
    per_tensor, per_channel, per_row = MaxCollector(), MaxCollector(axis=-1), MaxCollector(axis=0)
    for c in (per_tensor, per_channel):
        c.collect(a)
        c.collect(b)
    assert per_tensor.amax.shape == () and per_tensor.amax == both.max()
    assert torch.equal(per_channel.amax, both.amax(dim=0))
    per_row.collect(a)
    assert torch.equal(per_row.amax, a.abs().amax(dim=1))
    with pytest.raises(ConfigError, match="shape"):
        per_channel.collect(_randn(3, 5))
    per_channel.reset()
    assert per_channel.amax is None


def test_channel_stats_max_and_mean_over_batches():
    a, b = _randn(10, 6, seed=7), _randn(2, 3, 6, seed=8, scale=2)  # [T, C] and [B, T, C]
    rows = torch.cat([a, b.reshape(-1, 6)]).double().abs()  # [16, C]
    c = ChannelStatsCollector()
    c.collect(a)
    c.collect(b)
    assert c.count == 16
    assert c.max_abs.dtype == torch.float32 and c.mean_abs.dtype == torch.float32
    assert torch.equal(c.max_abs, rows.amax(dim=0).float())
    assert torch.allclose(c.mean_abs.double(), rows.mean(dim=0), rtol=1e-6)
    with pytest.raises(ConfigError, match="channels"):
        c.collect(torch.ones(2, 5))
    c.reset()
    assert c.max_abs is None and c.mean_abs is None and c.count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_collectors_stay_on_the_cuda_device():
    x = _randn(256, 64, seed=9).cuda()  # [T, C]
    h, s, m = HistogramCollector(bins=256), ChannelStatsCollector(), MaxCollector(axis=-1)
    for c in (h, s, m):
        c.collect(x)
        c.collect(x * 2)
    assert h.hist.is_cuda and s.max_abs.is_cuda and m.amax.is_cuda
    ref = HistogramCollector(bins=256)
    ref.collect(x.cpu())
    ref.collect(x.cpu() * 2)
    _close_counts(h.hist.cpu().numpy(), ref.hist.numpy(), slack=4)
    assert torch.allclose(s.mean_abs.cpu(), (x.abs().cpu() * 1.5).mean(dim=0), rtol=1e-5)

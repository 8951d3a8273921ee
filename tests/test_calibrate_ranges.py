"""Range functions: known answers, bad input, and agreement with an independent numpy implementation."""

import math
import time

import numpy as np
import pytest
import torch

from calibrate.collectors import HistogramCollector
from calibrate.methods import ALL_METHODS, CalibConfig, CalibMethod, parse_methods
from calibrate.ranges import (_kl_divergences, amax_entropy, amax_max, amax_mse, amax_percentile, compute_amax,
                              fake_quant, scale_from_amax, sqnr_db, sqnr_db_from_hist)
from model_zoo.errors import ConfigError


def _collect(x, bins=2048):
    c = HistogramCollector(bins=bins)
    c.collect(torch.as_tensor(x))
    return c.hist, c.edges


def _gaussian_with_outliers(n=2_000_000, seed=0):
    # MSE trades sum (o - a)^2 of clipping against N a^2 / (12 * 127^2) of rounding: its optimum is
    # far below the max only when the outliers are few against N / 193548 (here 4 against ~10)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))  # [n]
    x[:4] = torch.tensor([100.0, -50.0, 25.0, -12.0])
    return x


# ---- known answers -------------------------------------------------------------------------------

def test_percentile_90_of_arange_100_is_about_89():
    hist, edges = _collect(torch.arange(100, dtype=torch.float32))
    assert amax_percentile(hist, edges, 90.0) == pytest.approx(89.0, abs=1.0)


def test_percentile_100_is_the_max_and_max_is_the_last_edge():
    hist, edges = _collect(torch.arange(100, dtype=torch.float32))
    assert amax_percentile(hist, edges, 100.0) == pytest.approx(99.0, abs=99 / 2048 + 1e-9)
    assert amax_max(hist, edges) == pytest.approx(99.0)


def test_outliers_percentile_mse_entropy_clip_far_below_max():
    x = _gaussian_with_outliers()
    hist, edges = _collect(x)
    top = float(x.abs().max())
    assert top == 100.0
    assert amax_max(hist, edges) == pytest.approx(top)
    p = amax_percentile(hist, edges, 99.99)
    assert 3.0 < p < 5.0  # the Gaussian's 99.99th percentile of |x| is ~3.9
    for name, a in (("mse", amax_mse(hist, edges)), ("entropy", amax_entropy(hist, edges))):
        assert a < 0.2 * top, name
    # and clipping the outliers pays off in SQNR over the bulk of the data
    bulk = x[4:]
    assert sqnr_db(bulk, fake_quant(bulk, amax_mse(hist, edges))) > sqnr_db(bulk, fake_quant(bulk, top)) + 10


def test_entropy_never_folds_the_tail_onto_an_empty_bin():
    # pytorch-quantization builds Q from the bins before the fold: with the tail folded onto an empty
    # bin, P > 0 where Q = 0 and KL is infinite. A lone outlier above empty bins therefore keeps the max.
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(4))  # [n]
    x[0] = 100.0
    hist, edges = _collect(x)
    assert amax_entropy(hist, edges) == 100.0
    assert amax_mse(hist, edges) < 20.0


def test_uniform_mse_and_entropy_pick_about_the_max():
    x = torch.rand(500_000, generator=torch.Generator().manual_seed(1)) * 2 - 1  # [n] in [-1, 1)
    hist, edges = _collect(x)
    top = float(x.abs().max())
    assert amax_mse(hist, edges) == pytest.approx(top, rel=0.02)
    assert amax_entropy(hist, edges) == pytest.approx(top, rel=0.05)


def test_compute_amax_dispatches_with_config_parameters():
    hist, edges = _collect(_gaussian_with_outliers())
    cfg = CalibConfig(percentile=99.0, start_bin=64, stride=2)
    assert compute_amax("max", hist, edges, cfg) == amax_max(hist, edges)
    assert compute_amax(CalibMethod.PERCENTILE, hist, edges, cfg) == amax_percentile(hist, edges, 99.0)
    assert compute_amax("mse", hist, edges, cfg) == amax_mse(hist, edges, 64, 2)
    assert compute_amax("entropy", hist, edges, cfg) == amax_entropy(hist, edges, 64, 2)


def test_all_zero_histogram_gives_zero_amax():
    hist, edges = _collect(torch.zeros(1000))
    for m in ALL_METHODS:
        assert compute_amax(m, hist, edges) == 0.0


# ---- fake quantization ---------------------------------------------------------------------------

def test_scale_and_fake_quant_known_values():
    assert scale_from_amax(127.0) == 1.0
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.6, 300.0, -300.0])
    # amax 127 -> scale 1: round half to even, clamp to +-127
    expect = torch.tensor([0.0, 2.0, 2.0, -0.0, -2.0, 127.0, 127.0, -127.0])
    assert torch.equal(fake_quant(x, 127.0), expect)
    assert torch.equal(fake_quant(torch.zeros(3), 0.0), torch.zeros(3))
    y = fake_quant(torch.tensor([1.0, 0.25], dtype=torch.float16), 1.0)
    assert y.dtype == torch.float16 and y[0] == 1.0


def test_fake_quant_per_channel_amax_broadcasts():
    x = torch.tensor([[1.0, 10.0], [-0.5, 5.0]])  # [2, C=2]
    y = fake_quant(x, torch.tensor([1.0, 10.0]))
    assert torch.allclose(y, torch.tensor([[1.0, 10.0], [-64 / 127, 640 / 127]]))


def test_sqnr_known_values():
    x = torch.tensor([1.0, 1.0])
    assert sqnr_db(x, torch.tensor([1.0, 0.9])) == pytest.approx(10 * math.log10(2 / 0.01))
    assert sqnr_db(x, x) == math.inf


def test_sqnr_from_histogram_estimates_the_real_one():
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(2))
    hist, edges = _collect(x)
    for amax in (2.0, 4.0, float(x.abs().max())):
        assert sqnr_db_from_hist(hist, edges, amax) == pytest.approx(sqnr_db(x, fake_quant(x, amax)), abs=0.5)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.0, -1.0, 100.0001, 250.0])
def test_percentile_outside_0_100_is_a_config_error(p):
    with pytest.raises(ConfigError, match="invalid percentile"):
        CalibConfig(percentile=p)
    with pytest.raises(ConfigError, match="invalid percentile"):
        amax_percentile(np.ones(4), np.arange(5.0), p)


def test_unknown_method_bins_and_shapes_are_config_errors():
    with pytest.raises(ConfigError, match="unknown calibration method 'kl'.*entropy"):
        CalibConfig(method="kl")
    with pytest.raises(ConfigError, match="unknown calibration method"):
        parse_methods("median")
    with pytest.raises(ConfigError, match="invalid bins 127"):
        CalibConfig(bins=127)
    with pytest.raises(ConfigError, match="at least 128"):
        HistogramCollector(bins=64)
    with pytest.raises(ConfigError, match="edges"):
        amax_max(np.ones(4), np.arange(4.0))
    with pytest.raises(ConfigError, match="stride"):
        CalibConfig(stride=0)


def test_config_parsing_and_round_trip():
    assert parse_methods("all") is None and parse_methods("MSE") is CalibMethod.MSE
    assert CalibConfig().methods == ALL_METHODS
    cfg = CalibConfig(method="entropy", percentile=99.9, bins=1024)
    assert cfg.method is CalibMethod.ENTROPY and cfg.methods == (CalibMethod.ENTROPY,) and cfg.num_bits == 8
    assert CalibConfig.from_dict(cfg.to_dict()) == cfg
    assert CalibConfig.from_dict(CalibConfig().to_dict()) == CalibConfig()


# ---- speed: the CLI computes every method for ~200 capture points --------------------------------

def test_entropy_and_mse_over_2048_bins_are_fast():
    hist, edges = _collect(_gaussian_with_outliers(seed=3))
    amax_entropy(hist, edges)  # warm up
    t0 = time.perf_counter()
    amax_entropy(hist, edges)
    t_entropy = time.perf_counter() - t0
    t0 = time.perf_counter()
    amax_mse(hist, edges)
    t_mse = time.perf_counter() - t0
    assert t_entropy < 0.2 and t_mse < 1.0, (t_entropy, t_mse)


# ---- an independent implementation, written directly from the description ------------------------

def ref_percentile(hist, edges, p):
    cdf = np.cumsum(hist) / hist.sum()
    for i, c in enumerate(cdf):
        if c >= p / 100:
            return edges[i]
    return edges[-1]


def ref_mse(hist, edges, start_bin=128, stride=1):
    centers = (edges[:-1] + edges[1:]) / 2
    best, best_amax = None, None
    for i in range(start_bin, len(centers), stride):
        amax = centers[i]
        q = np.clip(np.round(centers / amax * 127), -128, 127) * amax / 127
        err = np.sum(hist * (q - centers) ** 2) / len(centers)
        if best is None or err < best * (1 - 1e-12):
            best, best_amax = err, amax
    return best_amax


def ref_kl_curve(hist, start_bin=128, stride=1, levels=128):
    b = hist.astype(np.float64).copy()
    b[0] = b[1]
    out = []
    for i in range(start_bin, len(b) + 1, stride):
        p = b[:i].copy()
        p[-1] += b[i:].sum()
        level = np.arange(i) * levels // i
        nonempty = b[:i] > 0
        level_sum = np.bincount(level, weights=b[:i], minlength=levels)
        level_cnt = np.bincount(level[nonempty], minlength=levels)
        q = np.zeros(i)
        q[nonempty] = level_sum[level[nonempty]] / level_cnt[level[nonempty]]
        p, q = p / p.sum(), q / q.sum()
        if np.any((p > 0) & (q == 0)):
            out.append(np.inf)
            continue
        m = p > 0
        out.append(float(np.sum(p[m] * np.log(p[m] / q[m]))))
    return np.array(out)


def ref_entropy(hist, edges, start_bin=128, stride=1):
    kl = ref_kl_curve(hist, start_bin, stride)
    best = np.flatnonzero(kl <= kl.min() * (1 + 1e-12))[-1]  # the last one on ties
    return edges[start_bin + best * stride]


def _random_cases():
    rng = np.random.default_rng(1234)
    heavy = np.abs(rng.standard_t(3, 100_000))
    outliers = np.abs(rng.standard_normal(100_000))
    outliers[:20] *= 40
    sparse = np.abs(rng.standard_normal(3_000))  # many empty bins
    laplace = np.abs(rng.laplace(size=100_000))
    for x in (heavy, outliers, sparse, laplace):
        yield x, np.histogram(x, bins=1024, range=(0, x.max()))


@pytest.mark.parametrize("case", range(4))
def test_matches_independent_numpy_implementation(case):
    x, (hist, edges) = list(_random_cases())[case]
    assert amax_max(hist, edges) == pytest.approx(x.max())
    for p in (90.0, 99.0, 99.99, 100.0):
        assert amax_percentile(hist, edges, p) == ref_percentile(hist, edges, p)
        # and the histogram percentile is within one bin of the exact one
        assert abs(amax_percentile(hist, edges, p) - np.percentile(x, p, method="inverted_cdf")) <= edges[1] + 1e-12
    assert amax_mse(hist, edges) == pytest.approx(ref_mse(hist, edges), rel=1e-12)
    assert amax_mse(hist, edges, 200, 3) == pytest.approx(ref_mse(hist, edges, 200, 3), rel=1e-12)
    assert amax_entropy(hist, edges) == ref_entropy(hist, edges)
    assert amax_entropy(hist, edges, 64, 5) == ref_entropy(hist, edges, 64, 5)
    # the whole KL curve, not only its argmin
    b = hist.astype(np.float64).copy()
    b[0] = b[1]
    ours = _kl_divergences(b, np.arange(128, len(b) + 1), 128)
    theirs = ref_kl_curve(hist)
    finite = np.isfinite(theirs)
    assert np.array_equal(np.isfinite(ours), finite)
    assert np.allclose(ours[finite], theirs[finite], rtol=1e-9, atol=1e-12)


def test_mse_direct_path_matches_the_reference_too(monkeypatch):
    import calibrate.ranges as ranges

    x, (hist, edges) = list(_random_cases())[0]
    shifted = edges + 0.5  # edges not starting at 0: no precomputed table applies
    assert amax_mse(hist, shifted) == pytest.approx(ref_mse(hist, shifted), rel=1e-12)
    monkeypatch.setattr(ranges, "_MSE_TABLE_MAX", 512)  # as for a histogram grown past the table
    assert ranges._mse_table(1024, 8) is None
    assert amax_mse(hist, edges) == pytest.approx(ref_mse(hist, edges), rel=1e-12)

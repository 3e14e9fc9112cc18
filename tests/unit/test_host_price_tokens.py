"""bench/host_price_tokens.py: the straight-line prices through 1 token and a second point, each as a
fraction of the time every token count took."""

from __future__ import annotations

from bench.host_price_tokens import lines


def test_each_line_passes_its_two_points_and_prices_the_rest_by_its_slope():
    measured = {1: 100e-6, 16: 130e-6, 64: 1000e-6, 128: 2000e-6}  # flat while memory bound, then compute bound
    got = lines(measured, [16, 64])
    assert got[16][1] == got[16][16] == 1.0 and got[64][64] == 1.0
    assert got[16][128] == round((100e-6 + 2e-6 * 127) / 2000e-6, 3)  # the flat slope prices 128 far too low
    assert got[64][128] == round((100e-6 + (900e-6 / 63) * 127) / 2000e-6, 3)

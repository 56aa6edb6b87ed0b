"""bench/adapter_scale.py's candidates: the shipped adapters' b scaled on the chosen weights and layers,
zero on the others, a untouched."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import adapter_scale  # noqa: E402


def test_scaled_adapters_scale_the_kept_b_and_zero_the_others():
    rng = np.random.default_rng(0)
    flat = {f"layers.{i}.{w}.{p}": rng.standard_normal((3, 2)).astype(np.float16)
            for i in range(4) for w in adapter_scale.PARTS["all"] for p in "ab"}
    out = adapter_scale.scaled_adapters(flat, 0.5, adapter_scale.PARTS["mlp"], range(1, 3))
    assert set(out) == set(flat)
    for name, value in out.items():
        _, layer, weight, part = name.split(".")
        if part == "a":
            np.testing.assert_array_equal(value, flat[name])
        elif weight in adapter_scale.PARTS["mlp"] and int(layer) in (1, 2):
            np.testing.assert_allclose(value, 0.5 * flat[name].astype(np.float32), rtol=0, atol=0)
        else:
            assert not value.any(), name
    whole = adapter_scale.scaled_adapters(flat, 1.0, adapter_scale.PARTS["all"], None)
    assert all(np.array_equal(whole[k], flat[k]) for k in flat)

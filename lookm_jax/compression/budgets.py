"""Per-layer budgets: how a method's ranked slots are split over the decoder's layers.

The uniform budget keeps, per row, the recent window M and N ranked slots in every layer. A layer
split keeps M and N_l in layer l with sum_l N_l = N_layers * N: the same total, so the cache holds
the same bytes, but each layer's buffer has its own static capacity and decode reads only what that
layer kept. The recent window stays whole in every layer, as PyramidKV keeps its observation window.

- "uniform": N_l = N.
- "pyramid": PyramidKV (Cai et al. 2024): N_l falls linearly with depth, from (2 - 1/beta) N in the
  first layer to N / beta in the last (their `min_num = (budget - window) // beta`,
  `max_num = 2 (budget - window) - min_num`).
- a tuple of N_layers positive weights: N_l proportional to the layer's weight.

N_l is rounded with cumulative floors, N_l = floor(F_l X) - floor(F_{l-1} X) with X = N_layers * N and
F_l the cumulative share of layers 0..l, so the N_l sum to X exactly. Each layer's static capacity is
M + its N_l at the bucket's N; a shorter row's N_l is clipped to it, so the row's total may fall a
slot or two short of X (never over), and no layer's buffer ever overflows.
"""

from __future__ import annotations

import functools

import numpy as np

from lookm_jax.checks import is_real
from lookm_jax.errors import InputError

UNIFORM, PYRAMID = "uniform", "pyramid"


def check_split(split, beta) -> None:
    """Refuse (``InputError``) a layer split other than "uniform", "pyramid" or positive weights."""
    if isinstance(split, str):
        if split not in (UNIFORM, PYRAMID):
            raise InputError(f"layer_split must be {UNIFORM!r}, {PYRAMID!r} or a tuple of positive per-layer "
                             f"weights, got {split!r}")
    elif not (isinstance(split, tuple) and split and all(is_real(w) and w > 0 for w in split)):
        raise InputError(f"layer_split weights must be a non-empty tuple of positive numbers, got {split!r}")
    if not (is_real(beta) and beta >= 1):
        raise InputError(f"pyramid_beta must be a number >= 1, got {beta!r}")


def layer_weights(split, num_layers: int, beta: float) -> np.ndarray:
    """[N_layers] float64 weights with mean 1 (split validated by `check_split`)."""
    if split == UNIFORM:
        return np.ones(num_layers)
    if split == PYRAMID:
        if num_layers == 1:
            return np.ones(1)
        return np.linspace(2 - 1 / beta, 1 / beta, num_layers)
    if len(split) != num_layers:
        raise InputError(f"layer_split gives {len(split)} weights for a model of {num_layers} layers")
    weights = np.asarray(split, np.float64)
    return weights / weights.mean()


@functools.lru_cache(maxsize=64)
def slot_table(split, num_layers: int, beta: float, max_ranked: int) -> np.ndarray:
    """[N_layers, max_ranked + 1] int32: entry [l, N] is layer l's ranked slots for a row whose uniform
    budget ranks N, clipped to the layer's share at N = max_ranked."""
    share = np.concatenate([[0.0], np.cumsum(layer_weights(split, num_layers, beta))]) / num_layers  # F_l
    share[-1] = 1.0
    totals = num_layers * np.arange(max_ranked + 1)  # X per N
    floors = np.floor(share[:, None] * totals[None, :] + 1e-9).astype(np.int64)  # [N_layers + 1, N + 1]
    table = np.diff(floors, axis=0)  # [N_layers, N + 1]
    return np.minimum(table, table[:, -1:]).astype(np.int32)


def layer_capacities(split, num_layers: int, beta: float, recent: int, ranked: int, length: int) -> tuple[int, ...]:
    """Each layer's static prompt slots for a bucket of `length` tokens whose uniform budget keeps
    `recent` + `ranked` per layer."""
    return tuple(min(length, recent + int(n)) for n in slot_table(split, num_layers, beta, ranked)[:, ranked])

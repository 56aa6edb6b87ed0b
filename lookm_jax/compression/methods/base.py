"""The method contract, and the scorer base every budget method derives from.

A method is a frozen (hashable, hence jit-static) dataclass called once per layer. A
``ScorerMethod`` subclass writes only ``score``: the base validates the budgets and the selection
spec once, at construction, and does capacity, per-row budgets and ``compress_kv`` (as kvpress's
``ScorerPress`` subclasses only compute scores).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.checks import is_int_at_least, is_real
from lookm_jax.compression import budgets
from lookm_jax.compression import heads as head_pool
from lookm_jax.compression.compress import CompressedKV, SelectionSpec, compress_kv
from lookm_jax.errors import InputError
from lookm_jax.compression.scoring import column_stats


class LayerIndex(NamedTuple):
    """Which layer a method is compressing: its index (traced inside the layer loop) and the static
    number of layers. Methods with per-layer budgets need it; the others ignore it."""

    index: jax.Array | int
    count: int


@dataclasses.dataclass(frozen=True)
class Method(abc.ABC):
    """A KV-cache compression method.

    ``capacity(bucket_len)`` is the static number of prompt slots it keeps for a bucket, in its
    largest layer; ``layer_capacities(bucket_len, num_layers)`` those of every layer. Calling it on
    one layer, ``method(queries, keys, values, is_image, valid, stats=None, layer=None)`` with queries
    [B, Hq, L, D] and keys/values [B, Hkv, L, D] (RoPE applied), is_image/valid [B, L] bool, layer a
    ``LayerIndex``, returns a ``CompressedKV`` of ``capacity`` slots, of which the first
    ``layer_capacities[layer]`` can be occupied (per head; a head-adaptive method pools its G head
    groups' slots, H_g x as many per group, ``CompressedKV.heads``). Pure and traceable with static shapes.

    ``statistics`` (a class constant, so static) names the column statistics of the prompt's
    causal attention that the method ranks by (``lookm_jax.compression.scoring.STATISTICS``). The prefill
    accumulates exactly those while it attends and passes them as ``stats``
    ({name: [B, Hkv, G, L] fp32}, G = Hq // Hkv); methods that declare none ignore ``stats``.
    """

    statistics: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def capacity(self, bucket_len: int) -> int: ...

    def layer_capacities(self, bucket_len: int, num_layers: int) -> tuple[int, ...]:
        """Each layer's static prompt slots; default: ``capacity`` in every layer."""
        return (self.capacity(bucket_len),) * num_layers

    def cache_layout(self, bucket_len: int, num_layers: int) -> tuple:
        """What shapes the method's decode cache (hashable): methods of equal layout decode together."""
        return self.layer_capacities(bucket_len, num_layers), False  # (slots per layer, size-aware slots)

    @abc.abstractmethod
    def __call__(self, queries, keys, values, is_image, valid, stats=None, layer=None) -> CompressedKV: ...

    def queries_read(self, bucket_len: int) -> int | None:
        """How many of each row's last valid queries the method reads (beyond ``stats``); None: it
        may read any query. A shared prefill (``generate.prefill_states``) keeps only those."""
        return None

    def check_prompt_lengths(self, lengths: np.ndarray) -> None:
        """Refuse (``InputError``) prompts of these real lengths [B] that the method cannot compress."""


def smallest_fraction(slots: int, length: int) -> float:
    """The smallest fraction f, rounded up to 4 decimals, with floor(f * length) >= slots."""
    return math.ceil(slots / length * 1e4) / 1e4


def floor_fraction(alpha: float, valid: jax.Array) -> jax.Array:
    """[B] int32 floor(alpha * L_b) of each row's valid length, exactly as Python's int(alpha * L).

    A static table over 0..bucket_len avoids fp32 rounding at the floor.
    """
    table = np.floor(alpha * np.arange(valid.shape[-1] + 1)).astype(np.int32)
    return jnp.asarray(table)[valid.sum(-1)]


def _is_fraction(x) -> bool:
    return is_real(x) and 0 <= x <= 1


@dataclasses.dataclass(frozen=True)
class ScorerMethod(Method):
    """Keeps M = floor(alpha_recent * L) recent + N = floor(alpha_important * L) top-scored slots per row.

    L is each row's own valid length; the static capacity uses the bucket length. Each alpha is a
    fraction in [0, 1] and their sum, the kept fraction of the prompt, lies in (0, 1].

    Subclasses implement ``score``; they may override ``selection`` (text-prior, merging, sinks:
    one ``SelectionSpec``), ``slots`` (how M + N splits into recent and ranked slots) and
    ``queries_read`` (a score that reads queries other than through ``stats``). A method that
    declares ``statistics`` gets them computed from queries and keys (``scoring.column_stats``, in
    query blocks of ``block`` rows) when called without ``stats``; ``block`` is also the token
    block of the merge's similarity scan.

    ``layer_split`` splits the total over the layers (``lookm_jax.compression.budgets``): "uniform"
    (M + N in every layer), "pyramid" (PyramidKV's linear schedule, steepness ``pyramid_beta``) or a
    tuple of per-layer weights; the recent window stays whole in every layer.

    ``head_split`` splits a layer's ranked slots over its KV heads: "uniform" (N per head) or
    "adaptive" (AdaKV: one top-k over the scores of all the heads of a group, each head keeping at
    least floor(``head_floor`` x N); `select.adaptive_head_slots`). An adaptive layer stores exactly
    its H_g x (M + N) slots per head group in one pool (`lookm_jax.compression.heads`).
    ``head_groups``: G, the groups heads are allocated within (on a mesh: the "model" shards, so no
    head's slots cross devices); None: the "model" axis of the mesh the method is traced under (1
    without one).
    """

    alpha_recent: float = 0.1
    alpha_important: float = 0.1
    block: int = 128
    RECENT_SHARE: ClassVar[float] = 0.5  # the recent window's share of a `get_method(..., budget=b)`
    layer_split: str | tuple[float, ...] = budgets.UNIFORM
    pyramid_beta: float = 20.0
    head_split: str = head_pool.UNIFORM
    head_floor: float = 0.2
    head_groups: int | None = None

    def __post_init__(self):
        if not (_is_fraction(self.alpha_recent) and _is_fraction(self.alpha_important)
                and 0 < self.alpha_recent + self.alpha_important <= 1):
            raise InputError(f"alpha_recent={self.alpha_recent!r} and alpha_important={self.alpha_important!r} "
                             "must be fractions in [0, 1] whose sum (the kept fraction of the prompt) is in (0, 1]")
        if not is_int_at_least(self.block, 1):
            raise InputError(f"block must be an int >= 1, got {self.block!r}")
        budgets.check_split(self.layer_split, self.pyramid_beta)
        spec = self.selection()  # validates the spec
        if self.head_split not in head_pool.HEAD_SPLITS:
            raise InputError(f"head_split must be one of {head_pool.HEAD_SPLITS}, got {self.head_split!r}")
        if not (_is_fraction(self.head_floor) and not isinstance(self.head_floor, bool)):
            raise InputError(f"head_floor must be a fraction in [0, 1], got {self.head_floor!r}")
        if not (self.head_groups is None or is_int_at_least(self.head_groups, 1)):
            raise InputError(f"head_groups must be None or an int >= 1, got {self.head_groups!r}")
        if self.head_split == head_pool.ADAPTIVE and (spec.keep_all_text or spec.similarity_filter):
            raise InputError("head_split='adaptive' cannot be combined with keep_all_text (its capacity is not "
                             "M + N) or similarity_filter (it compares the t-th evicted token of every head, and "
                             "adaptive heads evict different numbers)")

    # ---- what a subclass writes ----------------------------------------------------------------
    @abc.abstractmethod
    def score(self, queries, keys, valid, is_image, stats, n_recent) -> jax.Array:
        """-> [B, Hkv, L] float, higher = keep. queries [B, Hq, L, D], keys [B, Hkv, L, D], valid and
        is_image [B, L], stats {name: [B, Hkv, G, L]} (the declared ``statistics``), n_recent [B] int32
        (M per row)."""

    def selection(self) -> SelectionSpec:
        """Default: rank by score alone (no text-prior), evict without merging."""
        return SelectionSpec()

    def slots(self, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(recent window, ranked slots) per row, each [B] int32; default (M, N)."""
        return self.budgets(valid)

    def queries_read(self, bucket_len: int) -> int:
        return 0  # the score reads queries only through ``stats``

    # ---- what the base does --------------------------------------------------------------------
    def bucket_slots(self, bucket_len: int) -> tuple[int, int]:
        """(M, N) of a row filling the bucket."""
        return math.floor(self.alpha_recent * bucket_len), math.floor(self.alpha_important * bucket_len)

    def capacity(self, bucket_len: int) -> int:
        recent, ranked = self.bucket_slots(bucket_len)
        if self.layer_split == budgets.UNIFORM:
            return min(bucket_len, recent + ranked)
        # The largest layer's bound; weights of mean 1 give a layer at most max(w) N + 1 whatever the depth.
        if self.layer_split == budgets.PYRAMID:
            largest = 2 - 1 / self.pyramid_beta
        else:
            largest = max(self.layer_split) * len(self.layer_split) / sum(self.layer_split)
        return min(bucket_len, recent + math.ceil(largest * ranked) + 1)

    def layer_capacities(self, bucket_len: int, num_layers: int) -> tuple[int, ...]:
        if self.layer_split == budgets.UNIFORM:
            return super().layer_capacities(bucket_len, num_layers)
        return budgets.layer_capacities(self.layer_split, num_layers, self.pyramid_beta, *self.bucket_slots(bucket_len),
                                        bucket_len)

    def budgets(self, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-row (M, N), each [B] int32."""
        return floor_fraction(self.alpha_recent, valid), floor_fraction(self.alpha_important, valid)

    def check_prompt_lengths(self, lengths: np.ndarray) -> None:
        """Every row must keep a slot: floor(alpha_recent * L) + floor(alpha_important * L) >= 1."""
        shortest = int(np.min(lengths))
        if math.floor(self.alpha_recent * shortest) + math.floor(self.alpha_important * shortest) >= 1:
            return
        raise InputError(  # a budget b splits evenly: floor(b / 2 * L) >= 1 needs b >= 2 / L
            f"budget {self.alpha_recent + self.alpha_important:g} (alpha_recent={self.alpha_recent:g}, "
            f"alpha_important={self.alpha_important:g}) keeps no slot of a {shortest}-token prompt; the smallest "
            f"budget that keeps one is {smallest_fraction(2, shortest):g} (or one alpha of "
            f"{smallest_fraction(1, shortest):g})")

    def cache_layout(self, bucket_len: int, num_layers: int) -> tuple:
        layout = self.layer_capacities(bucket_len, num_layers), self.selection().size_aware
        return layout if self.head_split == head_pool.UNIFORM else layout + (self.head_split, self.head_groups)

    def groups(self) -> int | None:
        """The head groups of an adaptive split (``head_groups``, or the traced-under mesh's "model"
        shards); None: uniform."""
        if self.head_split == head_pool.UNIFORM:
            return None
        return head_pool.mesh_groups() if self.head_groups is None else self.head_groups

    def layer_slots(self, valid: jax.Array, layer: LayerIndex | None) -> tuple[jax.Array, jax.Array]:
        """(recent window, ranked slots) per row in this layer, each [B] int32: ``slots`` with the ranked
        ones cut to the layer's share (``layer_split``)."""
        n_recent, n_important = self.slots(valid)
        if self.layer_split == budgets.UNIFORM:
            return n_recent, n_important
        if layer is None:
            raise ValueError(f"layer_split={self.layer_split!r} needs the layer (layer=LayerIndex(index, count))")
        table = budgets.slot_table(self.layer_split, layer.count, self.pyramid_beta,
                                   self.bucket_slots(valid.shape[-1])[1])  # [N_layers, N_max + 1]
        return n_recent, jnp.asarray(table)[layer.index][n_important]

    def __call__(self, queries, keys, values, is_image, valid, stats=None, layer=None) -> CompressedKV:
        if self.statistics:
            if stats is None:
                stats = column_stats(queries, keys, valid, self.statistics, block=self.block)
            missing = set(self.statistics) - set(stats)
            if missing:
                raise ValueError(f"{type(self).__name__} needs attention statistics {sorted(missing)}")
        n_recent, n_important = self.layer_slots(valid, layer)
        m, _ = self.budgets(valid)
        return compress_kv(
            keys, values, self.score(queries, keys, valid, is_image, stats, m), is_image=is_image, valid=valid,
            n_recent=n_recent, n_important=n_important, **dataclasses.asdict(self.selection()),
            capacity=self.capacity(keys.shape[2]), block=self.block, head_groups=self.groups(),
            head_floor=self.head_floor,
        )

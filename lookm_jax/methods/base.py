"""The method contract: a frozen (hashable, hence jit-static) dataclass called once per layer."""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax.compress import CompressedKV
from lookm_jax.scoring import SUMS, column_stats


@dataclasses.dataclass(frozen=True)
class Method(abc.ABC):
    """A KV-cache compression method.

    ``capacity(bucket_len)`` is the static number of prompt slots it keeps for a bucket; calling
    it on one layer, ``method(queries, keys, values, is_image, valid, stats=None)`` with queries
    [B, Hq, L, D] and keys/values [B, Hkv, L, D] (RoPE applied), is_image/valid [B, L] bool,
    returns a ``CompressedKV`` of that capacity. Pure and traceable with static shapes.

    ``statistics`` (a class constant, so static) names the column statistics of the prompt's
    causal attention that the method ranks by (``lookm_jax.scoring.STATISTICS``). The prefill
    accumulates exactly those while it attends and passes them as ``stats``
    ({name: [B, Hkv, G, L] fp32}, G = Hq // Hkv); methods that declare none ignore ``stats``.
    """

    statistics: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def capacity(self, bucket_len: int) -> int: ...

    @abc.abstractmethod
    def __call__(self, queries, keys, values, is_image, valid, stats=None) -> CompressedKV: ...

    def queries_read(self, bucket_len: int) -> int | None:
        """How many of each row's last valid queries the method reads (beyond ``stats``); None: it
        may read any query. A shared prefill (``generate.prefill_states``) keeps only those."""
        return None


def floor_fraction(alpha: float, valid: jax.Array) -> jax.Array:
    """[B] int32 floor(alpha * L_b) of each row's valid length, exactly as Python's int(alpha * L).

    A static table over 0..bucket_len avoids fp32 rounding at the floor.
    """
    table = np.floor(alpha * np.arange(valid.shape[-1] + 1)).astype(np.int32)
    return jnp.asarray(table)[valid.sum(-1)]


@dataclasses.dataclass(frozen=True)
class BudgetMethod(Method):
    """A method that keeps M = floor(alpha_recent * L) + N = floor(alpha_important * L) slots per row.

    L is each row's own valid length; the static capacity uses the bucket length.
    """

    alpha_recent: float = 0.1
    alpha_important: float = 0.1

    def __post_init__(self):
        if self.alpha_recent < 0 or self.alpha_important < 0:
            raise ValueError(f"budget fractions must be >= 0, got {self.alpha_recent}, {self.alpha_important}")

    def capacity(self, bucket_len: int) -> int:
        total = math.floor(self.alpha_recent * bucket_len) + math.floor(self.alpha_important * bucket_len)
        return min(bucket_len, total)

    def budgets(self, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-row (M, N), each [B] int32."""
        return floor_fraction(self.alpha_recent, valid), floor_fraction(self.alpha_important, valid)


@dataclasses.dataclass(frozen=True)
class AttentionMethod(BudgetMethod):
    """A budget method that ranks tokens by column statistics of the prompt's attention.

    Subclasses set ``statistics`` and implement ``compress_from_stats``. Called without ``stats``
    (standalone use), the statistics are computed from queries and keys by
    ``scoring.column_stats`` in query blocks of ``block`` rows (static).
    """

    statistics: ClassVar[tuple[str, ...]] = (SUMS,)
    block: int = 128

    def __call__(self, queries, keys, values, is_image, valid, stats=None) -> CompressedKV:
        if stats is None:
            stats = column_stats(queries, keys, valid, self.statistics, block=self.block)
        missing = set(self.statistics) - set(stats)
        if missing:
            raise ValueError(f"{type(self).__name__} needs attention statistics {sorted(missing)}")
        return self.compress_from_stats(keys, values, is_image, valid, stats)

    def queries_read(self, bucket_len: int) -> int:
        return 0  # the statistics say all it needs

    @abc.abstractmethod
    def compress_from_stats(self, keys, values, is_image, valid, stats) -> CompressedKV:
        """keys/values [B, Hkv, L, D], is_image/valid [B, L], stats {name: [B, Hkv, G, L]}."""

"""The one list of method variants that every suite parametrises over (a new method or option added
here gets the reference, budget, padding, generation and mesh tests at once)."""

from __future__ import annotations

import jax.numpy as jnp

import reference_lookm as ref
from lookm_jax import METHODS, get_method
from lookm_jax.compression.scoring import RECONSTRUCTION, STATISTICS, column_stats

# (method name, options besides the budget). Each method's defaults come first, then its variants.
VARIANTS: list[tuple[str, dict]] = [(name, {}) for name in METHODS] + [
    ("snapkv", {"window": 6}),
    ("snapkv", {"window": None, "kernel_size": 5, "pooling": "avg"}),  # as LOOK-M's own SnapKV runs
    ("roco", {"std_weight": 1.0}),
    ("lookm", {"merge": None}),
    ("lookm", {"merge": "averaged"}),
    ("lookm", {"merge": "weighted"}),
    ("lookm", {"text_prior": False}),
    ("lookm", {"text_prior": False, "merge": None}),
    ("lookm", {"merge": "averaged", "similarity_filter": True}),
    ("lookm", {"merge": "weighted", "text_prior": False, "n_sink": 4}),
    ("lookm", {"keep_all_text": True, "merge": "pivotal"}),
    ("lookm", {"image_quota": 0.5, "merge": None}),
    ("lookm", {"image_quota": "proportional", "merge_scope": "same_modality"}),
    ("lookm", {"merge": "averaged", "size_aware": True}),
    ("adakv", {"head_floor": 0.0}),
    ("lookm", {"head_split": "adaptive", "merge": "averaged", "size_aware": True}),  # merged within each head
]
DEFAULTS = [v for v in VARIANTS if not v[1]]  # one per method, at its defaults


def variant_id(name: str, options: dict) -> str:
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def ids(variants) -> list[str]:
    return [variant_id(name, options) for name, options in variants]


def build(name: str, options: dict, **budget):
    """The method at `budget` (budget= or alpha_recent=/alpha_important=); "full" takes none."""
    return get_method(name, **options) if name == "full" else get_method(name, **budget, **options)


def doubled_stats(method, q, k, valid):
    """A method that reads the prompt twice over (lookm_quota's split scores) called outside a prefill: its
    statistics over the rows laid out [prompt ; copy] (`ref.doubled`), as a prefill gives them. None for
    other methods, which compute their own."""
    names = getattr(method, "statistics", ())
    if RECONSTRUCTION not in names:
        return None
    q2, k2, valid2, second = ref.doubled(q, k, valid)
    masks = {name: jnp.asarray(valid2 & ~second) for name in STATISTICS} | {RECONSTRUCTION: jnp.asarray(second)}
    stats = column_stats(*map(jnp.asarray, (q2, k2, valid2)), names, query_masks=masks)
    return {name: stat[..., :k.shape[2]] for name, stat in stats.items()}

"""Running on a device mesh: tensor parallel over KV heads ("model"), data parallel over rows ("data").

The compiled prefill and decode are the same functions as on one device; only where the arrays live
changes. Parameters are laid out Megatron-style (`param_specs`): attention q/k/v and the MLP's
gate/up are column parallel (their output features, i.e. whole heads, split over "model"), o and
down are row parallel (their input features split, the partial sums all-reduced), the embedding
and the LM head are split over the vocabulary, and the CLIP tower and projector follow the same
column/row pattern; norms, biases of row-parallel layers and anything not listed (other
architectures' vision parts) are replicated. A decoder layer then costs two all-reduces of the
hidden states, as in Megatron-LM.

Each layer's KV cache is [B over "data", Hkv over "model", ...] (keys [.., D, S], values
[.., S, D]), so each device holds, scores, compresses and attends to its own rows' own KV heads:
compression is per (row, head) and never gathers the cache (tests/mesh_check.py checks the
compiled HLO). Hkv must divide over "model". A head-adaptive method's pools ([B, G, ...], G head groups)
split their groups over "model": with G the "model" shards each device allocates among its own heads.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lookm_jax.cache import HeadPool, KVCache
from lookm_jax.checks import is_int_at_least

DATA, MODEL = "data", "model"

# (subtree, leaf) -> the mesh axis of each dimension. The decoder's layers are separate arrays with
# weights [out, in] (models/llama.py); the vision towers' leaves are stacked [N, in, out].
_COLUMN = P(None, None, MODEL)  # [N, in, out]: output features split
_ROW = P(None, MODEL, None)  # [N, in, out]: input features split
_LAYER_VECTOR = P(None, MODEL)  # [N, out] bias of a column-parallel layer
PARAM_RULES: dict[tuple[str, str], P] = {
    ("text", "embed"): P(MODEL, None),  # [V, H]: a masked local lookup + all-reduce; tied logits split over V
    ("text", "lm_head"): P(MODEL, None),  # [V, H]
    ("text", "w_qkv"): P(MODEL, None, None, None),  # [Hkv, G + 2, D, H]: whole KV heads with their queries
    ("text", "b_qkv"): P(MODEL, None, None),  # [Hkv, G + 2, D]: Qwen2's q/k/v biases
    ("text", "w_gate_up"): P(MODEL, None, None),  # [I, 2, H]: each row's gate and up together
    **{("text", k): P(None, MODEL) for k in ("wo", "w_down")},  # [out, in]
    **{("vision", k): _COLUMN for k in ("wq", "wk", "wv", "fc1_w")},
    **{("vision", k): _LAYER_VECTOR for k in ("bq", "bk", "bv", "fc1_b")},
    **{("vision", k): _ROW for k in ("wo", "fc2_w")},
    ("projector", "w1"): P(None, MODEL),  # [H_in, H]
    ("projector", "b1"): P(MODEL),
    ("projector", "w2"): P(MODEL, None),
}

KV_SPEC = P(DATA, MODEL, None, None)  # each layer's cache keys [B, Hkv, D, S] / values [B, Hkv, S, D]
POSITIONS_SPEC = P(DATA, MODEL, None)  # each layer's cache positions [B, Hkv, S]
ROWS = P(DATA)  # [B, ...] inputs: ids, valid, first tokens


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model devices (model defaults to all the rest).

    Both axes are `AxisType.Auto`: shardings are placed on the inputs and XLA propagates them, so
    the single-device code needs no sharding annotations in its types.
    """
    devices = jax.devices() if devices is None else devices
    if not is_int_at_least(data, 1) or not (model is None or is_int_at_least(model, 1)):
        raise ValueError(f"data and model must be ints >= 1 (model may be None), got {data!r}, {model!r}")
    if model is None:
        model = len(devices) // data
    if model < 1 or data * model > len(devices):
        raise ValueError(f"a {data} x {model} (data x model) mesh needs {data * model} devices, "
                         f"{len(devices)} available")
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2, devices=devices)


def _path_keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def spec_of(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The rule for a parameter at the dotted `path` ("text.layers.3.w_qkv": its top-level subtree
    and leaf name); replicated where no rule applies or a split dimension does not divide evenly
    over its axis."""
    keys = path.split(".")
    spec = PARAM_RULES.get((keys[0], keys[-1]), P())
    if len(spec) > len(shape):
        return P()
    for size, axis in zip(shape, spec):
        if axis is not None and size % mesh.shape[axis]:
            return P()
    return spec


def param_specs(params: dict, mesh: Mesh) -> dict:
    """The PartitionSpec of every parameter (same tree structure as params)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_of(".".join(_path_keys(path)), leaf.shape, mesh), params)


def shard_params(params: dict, mesh: Mesh) -> dict:
    """params placed on the mesh by `param_specs` (`lookm_jax.load(..., mesh=)` places each as it is read instead)."""
    specs = param_specs(params, mesh)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


def check_mesh(mesh: Mesh, num_kv_heads: int | None = None, batch: int | None = None) -> None:
    """KV heads must split evenly over "model" and rows over "data" (compression is per row and head)."""
    if set(mesh.axis_names) != {DATA, MODEL}:
        raise ValueError(f"mesh axes must be {(DATA, MODEL)} (see make_mesh), got {mesh.axis_names}")
    if num_kv_heads is not None and num_kv_heads % mesh.shape[MODEL]:
        raise ValueError(f"{num_kv_heads} KV heads do not split over a '{MODEL}' axis of size "
                         f"{mesh.shape[MODEL]}")
    if batch is not None and batch % mesh.shape[DATA]:
        raise ValueError(f"a batch of {batch} rows does not split over a '{DATA}' axis of size "
                         f"{mesh.shape[DATA]}; pad the batch to a multiple")


def place_rows(mesh: Mesh, *arrays) -> list[jax.Array]:
    """[B, ...] host arrays split over "data" (rows), replicated over "model"."""
    check_mesh(mesh, batch=arrays[0].shape[0])
    return [jax.device_put(a, NamedSharding(mesh, ROWS)) for a in arrays]


def cache_specs(cache: KVCache) -> KVCache:
    """The PartitionSpec of every cache leaf: rows over "data", KV heads (a pool's head groups) over "model"."""
    n = cache.num_layers
    pools = None
    if cache.layer_pools is not None:
        pools = tuple(HeadPool(keys=KV_SPEC, values=KV_SPEC, positions=POSITIONS_SPEC, heads=POSITIONS_SPEC,
                               log_counts=None if p.log_counts is None else POSITIONS_SPEC) for p in cache.layer_pools)
    return KVCache(layer_keys=(KV_SPEC,) * n, layer_values=(KV_SPEC,) * n, layer_positions=(POSITIONS_SPEC,) * n,
                   cursor=P(), next_position=P(DATA), layer_shifts=cache.layer_shifts,
                   layer_log_counts=None if cache.layer_log_counts is None else (POSITIONS_SPEC,) * n,
                   layer_pools=pools)


def constrain_cache(cache: KVCache) -> KVCache:
    """Pin the cache to [B over "data", Hkv over "model", ..] per layer when traced under
    `jax.set_mesh` with a (data, model) mesh; unchanged otherwise (one device: no-op, identical numerics)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) != {DATA, MODEL}:
        return cache
    return jax.tree.map(jax.lax.with_sharding_constraint, cache, cache_specs(cache))

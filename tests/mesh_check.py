"""Mesh checks on 4 host CPU devices; tests/test_mesh.py runs this module with pytest in a subprocess.

XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before jax starts, and the rest of
the suite runs on one device in one process, hence the subprocess. Run alone:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest -q tests/mesh_check.py

The tiny LLaVA is built from random params of the conversion tables' shapes, with sizes picked so a
per-head array is recognisable in HLO by its shape: head_dim D = 8 is the last dim of Q, K, V and
the cache and of nothing else (hidden 48, MLP 96, vocab 256, vision 32 with head_dim 16), and
the prompt bucket L = 64, the kept slots (24) and the decode capacity (28) end only per-head arrays
of rank >= 3 (positions, scores, attention statistics, selection masks).
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import lookm_jax
from method_variants import DEFAULTS, build, doubled_stats
from lookm_jax import Model, generate as gen, get_method, sharding
from lookm_jax.convert import store
from lookm_jax.convert.hf import flat_paths, params_from_hf, parse_config
from lookm_jax.convert.tables import ShapesOnly, clip_shapes, llama_shapes, projector_shapes
from lookm_jax.compression.methods.base import LayerIndex
from lookm_jax.models import llama
from lookm_jax.models.config import CLIPVisionConfig, LlamaConfig, LlavaConfig, RopeConfig

D, BUCKET, NEW = 8, 64, 4
IMAGE = 255
MESHES = {"2x2": (2, 2), "4x1": (4, 1)}  # data x model
# LOOK-M: pivotal merge. AdaKV: its heads allocated within the 2 head groups a 2-way "model" axis
# holds (on one device too, so the caches agree), at a budget whose pool (2 x 32 slots) is BUCKET long.
# The composite scored by context reconstruction: its prefill encodes the prompt twice over.
RUN_METHODS = {"full": get_method("full"), "lookm": get_method("lookm", budget=0.4),
               "adakv": get_method("adakv", budget=0.5, head_groups=2),
               "reconstruction": get_method("lookm_quota", budget=0.4, scores="reconstruction")}
# Each pair costs a prefill + decode compile: LOOK-M on both meshes, the others on 2x2.
MESH_RUNS = [("2x2", "full"), ("2x2", "lookm"), ("4x1", "lookm"), ("2x2", "adakv"), ("2x2", "reconstruction")]
KEPT = RUN_METHODS["lookm"].capacity(BUCKET)  # 24
# (2 x BUCKET: AdaKV's one ranking over a head group's candidates, and the prompt encoded twice over)
PER_HEAD_LENGTHS = {BUCKET, KEPT, KEPT + NEW, BUCKET + NEW, 2 * BUCKET}
COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (?P<shape>.+?) "
                        r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _random_params(shapes: dict, rng: np.random.Generator) -> dict:
    """Nested params from {"a.b": shape}: norms ~U(0.5, 1.5), matrices ~N(0, 1/fan_in), the rest small."""
    params: dict = {}
    for path, shape in shapes.items():
        name = path.split(".")[-1]
        if "norm" in name or name.startswith("ln"):
            value = rng.uniform(0.5, 1.5, shape)
        elif name == "embed":
            value = rng.standard_normal(shape)
        elif len(shape) >= 2:
            value = rng.standard_normal(shape) * shape[-2] ** -0.5
        else:
            value = 0.1 * rng.standard_normal(shape)
        *parents, leaf = path.split(".")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(value, jnp.float32)
    return params


def tiny_model() -> Model:
    text = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=8,
                       num_kv_heads=4, head_dim=D, rms_norm_eps=1e-5, rope=RopeConfig(theta=1000.0))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=30,
                              patch_size=6)  # 25 patches
    cfg = LlavaConfig(text=text, vision=vision, image_token_id=IMAGE)
    rng = np.random.default_rng(0)
    params = {"text": llama.runtime_params(text, _random_params(llama_shapes(text), rng)), "vision": _random_params(clip_shapes(vision), rng),
              "projector": _random_params(projector_shapes(cfg), rng)}
    return Model(config=cfg, params=params, manifest={})


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(op, result shapes) of every collective instruction in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        match = COLLECTIVE.match(line)
        if match:
            shapes = [tuple(int(d) for d in dims.split(",") if d)
                      for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", match["shape"])]
            found.append((match["op"], shapes))
    return found


def per_head_collectives(hlo: str, head_dim: int = D, lengths=PER_HEAD_LENGTHS) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Collectives that move a per-head array: K, V, Q or the cache ([.., T, D]), or positions,
    scores, statistics or selections ([.., T] of rank >= 3), T a prompt or cache length."""
    def per_head(shape):
        return len(shape) >= 3 and (shape[-1] == head_dim or shape[-1] in lengths)

    return [(op, shapes) for op, shapes in collectives(hlo) if any(map(per_head, shapes))]


@pytest.fixture(scope="module")
def model():
    assert jax.device_count() == 4, (
        f"{jax.device_count()} device(s): run through tests/test_mesh.py, or set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax starts")
    return tiny_model()


@pytest.fixture(scope="module")
def prompt():
    """4 ragged rows (3 images of 25 tokens), left- and right-padded: the 64-token bucket."""
    rows = [[3, *[IMAGE] * 25, 5, 6, 7, 8, 9], list(range(10, 40)), [*[IMAGE] * 25, *range(40, 60)],
            [11, *[IMAGE] * 25, 12, 13]]
    width = max(map(len, rows))
    ids, mask = np.zeros((4, width), np.int32), np.zeros((4, width), np.int32)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if i % 2 == 0 else slice(width - len(row), width)
        ids[i, span], mask[i, span] = row, 1
    pixels = np.random.default_rng(1).standard_normal((3, 3, 30, 30)).astype(np.float32)
    return ids, pixels, mask


def _run(model, prompt, method):
    """Model.run, then the cache of the same compiled prefill (called again on the same inputs)."""
    ids, pixels, mask = prompt
    result = model.run(ids, pixels, attention_mask=mask, max_new_tokens=NEW, method=method)
    (prefill, decode), = [v for k, v in model._compiled.items() if k[2] == method]
    packed, valid = model._rows(*gen.pack_prompts(ids, mask, model.buckets))
    _, cache, _ = prefill(model.params, packed, valid, jnp.asarray(pixels), jax.random.key(0))
    return result, cache, prefill, decode


@pytest.fixture(scope="module")
def single(model, prompt):
    """Single-device reference per method: (result, cache), and the logits."""
    runs = {name: _run(model, prompt, m)[:2] for name, m in RUN_METHODS.items()}
    return runs, model.logits(prompt[0], prompt[1], attention_mask=prompt[2])


@pytest.fixture(scope="module")
def sharded(model):
    """The tiny model laid out on each mesh, built on first use."""
    built = {}

    def get(mesh_name):
        if mesh_name not in built:
            built[mesh_name] = model.shard(sharding.make_mesh(*MESHES[mesh_name]))
        return built[mesh_name]
    return get


@pytest.mark.parametrize("mesh_name,name", MESH_RUNS)
def test_mesh_generation_equals_single_device_without_gathering_kv(sharded, single, prompt, mesh_name, name):
    """Tokens equal, kept slots equal, cache K/V to 1e-5; the cache stays split, 1/4 per device;
    no collective of the compiled prefill (which compresses) or decode moves a per-head array or
    gathers a whole weight."""
    sharded_model = sharded(mesh_name)
    result, cache, prefill, decode = _run(sharded_model, prompt, RUN_METHODS[name])
    ref, ref_cache = single[0][name]
    np.testing.assert_array_equal(result.tokens, ref.tokens, err_msg=f"{mesh_name} {name}: tokens")
    np.testing.assert_array_equal(cache.positions, ref_cache.positions, err_msg=f"{mesh_name} {name}: kept slots")
    for field in ("keys", "values"):
        np.testing.assert_allclose(getattr(cache, field), getattr(ref_cache, field), atol=1e-5, rtol=0,
                                   err_msg=f"{mesh_name} {name}: cache {field}")
    assert result.cache_bytes == ref.cache_bytes
    kv_split = NamedSharding(sharded_model.mesh, sharding.KV_SPEC)
    assert all(k.sharding.is_equivalent_to(kv_split, 4) for k in cache.layer_keys + cache.layer_values)
    data, model_axis = MESHES[mesh_name]
    slots = NEW if cache.layer_pools else RUN_METHODS[name].capacity(BUCKET) + NEW  # a pool holds the prompt
    chex.assert_shape([k.addressable_shards[0].data for k in cache.layer_keys],  # keys [B, Hkv, D, S]
                      [(4 // data, 4 // model_axis, D, slots)] * 2)
    if cache.layer_pools:  # each device holds its own head group's pool: [B, G, D, H_g x P]
        assert all(p.keys.sharding.is_equivalent_to(kv_split, 4) for p in cache.layer_pools)
        chex.assert_shape([p.keys.addressable_shards[0].data for p in cache.layer_pools],
                          [(4 // data, 2 // model_axis, D, BUCKET)] * 2)
    weights = {a.shape for a in jax.tree.leaves(sharded_model.params) if a.ndim >= 2}
    for program_name, program in (("prefill", prefill), ("decode", decode)):
        moved = per_head_collectives(program.as_text())
        assert not moved, f"{mesh_name} {name} {program_name}: collectives move per-head arrays: {moved}"
        gathered = [shape for op, shapes in collectives(program.as_text()) if op == "all-gather"
                    for shape in shapes if shape in weights]
        assert not gathered, f"{mesh_name} {name} {program_name}: whole weights gathered: {gathered}"


def test_mesh_logits_equal_single_device(sharded, single, prompt):
    logits = sharded("2x2").logits(prompt[0], prompt[1], attention_mask=prompt[2])
    np.testing.assert_allclose(logits, single[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [name for name, _ in DEFAULTS])
def test_compression_alone_has_no_collectives(model, name):
    """Every method, compiled on its own with q/k/v split over (rows, heads) on the 2x2 mesh: no
    collective at all (it is per row and head), and its output stays split, [B/2, Hkv/2, S, D] per
    device (numerics on a mesh: the generation test above). One exception, not a per-head array:
    SnapKV's top_k over the [B, L] positions of its query window, whose rows XLA's partitioner
    gathers (SnapKV's window scores, also the votes of lookm_quota's split scores)."""
    method = build(name, {"head_groups": 2} if name == "adakv" else {}, budget=0.4)  # a head group per device
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((4, h, BUCKET, D)).astype(np.float32) for h in (8, 4, 4))
    valid = np.arange(BUCKET)[None] < np.asarray([64, 50, 33, 60])[:, None]
    is_image = (np.arange(BUCKET)[None] % 3 == 0) & valid
    mesh = sharding.make_mesh(2, 2)
    heads = NamedSharding(mesh, P(sharding.DATA, sharding.MODEL))
    args = [jax.device_put(a, heads) for a in (q, k, v)]
    args += [jax.device_put(a, NamedSharding(mesh, sharding.ROWS)) for a in (is_image, valid)]
    stats = doubled_stats(method, q, k, valid)  # the doubled prefill's statistics (lookm_quota's split scores)
    stats = stats and {statistic: jax.device_put(a, heads) for statistic, a in stats.items()}
    compiled = jax.jit(functools.partial(method, layer=LayerIndex(0, 3))).lower(*args, stats=stats).compile()
    expected = [("all-gather", [(4, BUCKET)])] if name in ("snapkv", "pyramidkv", "adakv", "lookm_quota") else []
    assert collectives(compiled.as_text()) == expected, name
    kept = compiled(*args, stats=stats)
    assert kept.keys.sharding.is_equivalent_to(heads, 4), kept.keys.sharding
    pooled = kept.heads is not None  # [B, G, H_g x S, D]: one head group of two heads per device
    chex.assert_shape(kept.keys.addressable_shards[0].data, (2, 1, 2 * method.capacity(BUCKET), D) if pooled
                      else (2, 2, method.capacity(BUCKET), D))


def test_detector_sees_a_gathered_cache_and_an_iota_indexed_scatter():
    """Positive controls for `per_head_collectives`: a cache pinned replicated (all-gather), and a
    merge-style scatter indexed with explicit [B, H] iotas (all-reduce of a full-size K)."""
    mesh = sharding.make_mesh(2, 2)
    split = NamedSharding(mesh, P(sharding.DATA, sharding.MODEL))
    keys = jax.device_put(jnp.ones((4, 4, BUCKET, D)), split)
    target = jax.device_put(jnp.zeros((4, 4, BUCKET), jnp.int32), split)
    gathered = jax.jit(lambda k: jax.lax.with_sharding_constraint(k * 2, NamedSharding(mesh, P())))

    def iota_scatter(target, keys):
        rows, heads = jnp.arange(4)[:, None, None], jnp.arange(4)[None, :, None]
        return jnp.zeros((4, 4, KEPT, D)).at[rows, heads, target].add(keys, mode="drop")

    for fn, op in ((gathered, "all-gather"), (jax.jit(iota_scatter), "all-reduce")):
        args = (keys,) if fn is gathered else (target, keys)
        moved = per_head_collectives(fn.lower(*args).compile().as_text())
        assert any(found == op for found, _ in moved), moved


def test_meshes_that_do_not_fit_are_refused(model, prompt):
    with pytest.raises(ValueError, match="8 devices, 4 available"):
        sharding.make_mesh(4, 2)
    for data in (0, "1"):
        with pytest.raises(ValueError, match=rf"data and model must be ints >= 1 \(model may be None\), got {data!r}"):
            sharding.make_mesh(data)
    with pytest.raises(ValueError, match="4 KV heads do not split over a 'model' axis of size 3"):
        model.shard(sharding.make_mesh(1, 3))
    two_by_two = model.shard(sharding.make_mesh(2, 2))
    with pytest.raises(ValueError, match="a batch of 3 rows does not split over a 'data' axis of size 2"):
        two_by_two.run(prompt[0][:3], prompt[1][:2], attention_mask=prompt[2][:3], max_new_tokens=NEW)


def test_load_places_each_parameter_split_over_the_mesh(tmp_path, prompt):
    """`lookm_jax.load(folder, mesh=)` puts each parameter on the devices as it is read, split by
    `param_specs`: every device holds only its slice of a split weight (its buffer is 1/2 of the
    whole on the 2x2 mesh's "model" axis), and the logits equal a single-device load's."""
    hf_config = {"model_type": "llava", "image_token_index": IMAGE, "vision_feature_layer": -2,
                 "text_config": {"model_type": "llama", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 96,
                                 "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                                 "head_dim": D, "rms_norm_eps": 1e-5, "rope_theta": 1000.0},
                 "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                   "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 30, "patch_size": 6}}
    shapes = flat_paths(params_from_hf(parse_config(hf_config), ShapesOnly()))
    params = _random_params(shapes, np.random.default_rng(3))
    store.save_converted(str(tmp_path / "c"), params, {"hf_config": hf_config})
    mesh = sharding.make_mesh(2, 2)
    single, split = lookm_jax.load(str(tmp_path / "c")), lookm_jax.load(str(tmp_path / "c"), mesh=mesh)
    assert split.mesh is mesh
    specs = jax.tree.leaves(sharding.param_specs(split.params, mesh), is_leaf=lambda x: isinstance(x, P))
    halves = 0
    for (path, a), spec in zip(jax.tree_util.tree_flatten_with_path(split.params)[0], specs):
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), jax.tree_util.keystr(path)
        parts = 2 if sharding.MODEL in spec else 1
        assert {s.data.nbytes for s in a.addressable_shards} == {a.nbytes // parts}, jax.tree_util.keystr(path)
        halves += parts == 2
    assert halves >= 2 * 4 + 2  # per decoder layer w_qkv, wo, w_gate_up, w_down; embed, lm_head (and the tower's)
    np.testing.assert_allclose(split.logits(prompt[0], prompt[1], attention_mask=prompt[2]),
                               single.logits(prompt[0], prompt[1], attention_mask=prompt[2]), atol=1e-5, rtol=0)


def test_qwen2_vl_on_a_mesh_equals_single_device(tmp_path_factory):
    """A second architecture on the 2x2 mesh: Qwen2-VL (M-RoPE positions, dynamic-resolution patches
    of three sizes, GQA 6/2 heads of width 16), loaded straight onto the mesh. LOOK-M's tokens and
    compressed context equal one device's; the cache stays split over rows and KV heads; no collective
    of the compiled prefill, context prefill or decode moves a per-head array."""
    from lookm_jax.models.qwen2_vl import Pixels
    from lookm_jax.models.qwen2_vl_processing import Qwen2VLImageProcessorConfig, preprocess_patches
    from tests.test_qwen2_vl import END, IMAGE_TOKEN, PROCESSOR, START, _images, tiny_qwen2_vl

    path = tmp_path_factory.mktemp("qwen2_vl")
    tiny_qwen2_vl(path)
    folder = str(path)
    single = lookm_jax.load(folder)
    mesh = sharding.make_mesh(2, 2)
    on_mesh = lookm_jax.load(folder, mesh=mesh)
    patches, grid = preprocess_patches(_images(), Qwen2VLImageProcessorConfig(**PROCESSOR))
    tokens = [int(t * h * w) // 4 for t, h, w in grid]
    image = lambda n: [START] + [IMAGE_TOKEN] * tokens[n] + [END]  # noqa: E731
    rows = [[0, 1] + image(0) + [2, 3] + image(1) + [4, 5, 2], [3] + image(2) + [0, 1, 2, 3, 4, 5, 0, 1]]
    width = max(map(len, rows))
    ids = np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32)
    mask = np.asarray([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int32)
    pixels = Pixels(patches, grid)
    method = get_method("lookm", budget=0.4)

    ref = single.run(ids, pixels, attention_mask=mask, max_new_tokens=NEW, method=method)
    got = on_mesh.run(ids, pixels, attention_mask=mask, max_new_tokens=NEW, method=method)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    ref_ctx, ctx = (m.prefill_context(ids, pixels, attention_mask=mask, method=method) for m in (single, on_mesh))
    np.testing.assert_array_equal(ctx.cache.positions, ref_ctx.cache.positions)
    np.testing.assert_allclose(ctx.cache.keys, ref_ctx.cache.keys, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(ctx.cache.next_position, ref_ctx.cache.next_position)  # M-RoPE's max + 1
    kv_split = NamedSharding(mesh, sharding.KV_SPEC)
    assert all(k.sharding.is_equivalent_to(kv_split, 4) for k in ctx.cache.layer_keys + ctx.cache.layer_values)
    bucket, cfg = got.bucket, on_mesh.text_config
    kept = method.capacity(bucket)
    lengths = {bucket, kept, kept + NEW, bucket + NEW}
    programs = [p for value in on_mesh._compiled.values() for p in (value if isinstance(value, tuple) else (value,))]
    assert len(programs) == 3  # run's prefill and decode, the context's prefill
    for program in programs:
        moved = per_head_collectives(program.as_text(), cfg.head_dim, lengths)
        assert not moved, f"collectives move per-head arrays: {moved}"

"""HF checkpoint conversion: naming variants, shards, refusals, converted save/reload, atomic writes."""

from __future__ import annotations

import json
import os
import re
import stat

import jax
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

import lookm_jax
from conftest import tiny_llava
from lookm_jax import loading
from lookm_jax.convert import safetensors_io, store
from lookm_jax.convert.hf import CheckpointError
from lookm_jax.convert.tables import canonical_name
from lookm_jax.errors import InputError
from lookm_jax.models.config import ConfigError
from original_layout import save_checkpoint, tiny_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_llava(folder)
    return folder


def copy_with(src, dst, rename=None, shards=1, drop=(), config_edit=None):
    """Rewrite a checkpoint folder: renamed tensor keys, n shards + index, dropped tensors, config edits."""
    os.makedirs(dst, exist_ok=True)
    tensors = {(rename(k) if rename else k): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()
               if k not in drop}
    config = json.load(open(os.path.join(src, "config.json")))
    if config_edit:
        config_edit(config)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    if shards == 1:
        save_file(tensors, os.path.join(dst, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, os.path.join(dst, shard))
        weight_map.update({k: shard for k in part})
    json.dump({"weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))


def assert_same_params(a, b):
    flat_a, flat_b = (dict(jax.tree_util.tree_flatten_with_path(m.params)[0]) for m in (a, b))
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=jax.tree_util.keystr(k))


@pytest.mark.parametrize("style", ["hub", "transformers5_model_prefix"])
def test_naming_variants_and_shards_give_identical_params(checkpoint, tmp_path, style):
    def rename(k):
        if style == "hub":  # llava-hf on the hub: vision_tower.vision_model.*
            return k.replace("vision_tower.", "vision_tower.vision_model.")
        return "model." + k.replace("language_model.model.", "language_model.") if not k.startswith(
            "language_model.lm_head") else "lm_head.weight"

    copy_with(checkpoint, tmp_path, rename=rename, shards=3)
    assert_same_params(lookm_jax.load(str(checkpoint)), lookm_jax.load(str(tmp_path)))


def test_missing_shard(checkpoint, tmp_path):
    copy_with(checkpoint, tmp_path, shards=2)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"missing shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        lookm_jax.load(str(tmp_path))


def test_corrupt_shard(checkpoint, tmp_path):
    copy_with(checkpoint, tmp_path, shards=2)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: corrupt"):
        lookm_jax.load(str(tmp_path))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    copy_with(checkpoint, tmp_path, drop=("multi_modal_projector.linear_2.weight",))
    with pytest.raises(CheckpointError, match="projector.linear_2.weight"):
        lookm_jax.load(str(tmp_path))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_tensor_with_nan_or_inf_is_named(checkpoint, tmp_path, value):
    copy_with(checkpoint, tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    name = next(k for k in tensors if k.endswith("layers.1.self_attn.k_proj.weight") and "vision" not in k)
    tensors[name][2, 3] = value  # one entry of a stacked layer's weight: the rest would load and answer garbage
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    named = re.escape(canonical_name(name))  # as the loader names every tensor, "lacks tensor(s)" included
    with pytest.raises(CheckpointError, match=rf"^checkpoint tensor {named} holds NaN or inf$"):
        lookm_jax.load(str(tmp_path))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_all_finite_reads_every_block_and_both_signs(dtype):
    """`tables.all_finite` on a tensor of several blocks: the extremes and subnormals pass, and NaN or
    inf of either sign is found wherever it sits (first block, a later one, the last element)."""
    import ml_dtypes

    from lookm_jax.convert import tables

    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    info = ml_dtypes.finfo(np_dtype)
    a = np.random.default_rng(0).standard_normal(3 * tables._FINITE_BLOCK + 6).astype(np_dtype)
    a[:4] = [info.max, -info.max, info.smallest_subnormal, -info.smallest_subnormal]
    assert tables.all_finite(a.reshape(-1, 6))
    for where in (7, 2 * tables._FINITE_BLOCK + 1, a.size - 1):
        for bad in (np.inf, -np.inf, np.nan, -np.nan):
            b = a.copy()
            b[where] = bad
            assert not tables.all_finite(b), (where, bad)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["text_config"].update(sliding_window=128), r"unsupported config field\(s\) \['sliding_window'\]"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias=True"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type='yarn'"),
    (lambda c: c.update(projector_hidden_act="relu"), "projector_hidden_act='relu'"),
    (lambda c: c["vision_config"].update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda c: c.update(vision_feature_select_strategy="pooled"), "vision_feature_select_strategy='pooled'"),
    (lambda c: c["text_config"].update(num_hidden_layers=0), r"config sizes must be >= 1, got \{'num_hidden_layers': 0\}"),
    (lambda c: c["text_config"].update(rms_norm_eps="abc"), "text_config: rms_norm_eps must be a number, got 'abc'"),
    (lambda c: c["text_config"].update(num_key_value_heads=0), r"config sizes must be >= 1, got \{'num_key_value_heads': 0\}"),
    (lambda c: c["text_config"].update(vocab_size=1.7), "text_config: vocab_size must be an integer, got 1.7"),
    (lambda c: c["text_config"].update(rms_norm_eps=-1.0), "rms_norm_eps and rope_theta must be > 0"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     r"rope_parameters and rope_scaling / rope_theta disagree on rope_type \('default' vs 'llama3'\); keep one"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_theta": 1e4}, rope_theta=5e5),
     r"disagree on rope_theta \(10000.0 vs 500000.0\)"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
     r"llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     r"llama3 scaling needs numbers"),
    (lambda c: c["text_config"].update(eos_token_id=[2, 100000]), r"eos_token_id 100000 outside the vocabulary \[0, "),
    (lambda c: c["text_config"].update(eos_token_id="2"), "eos_token_id must be an integer or a list of them, got '2'"),
])
def test_unsupported_config_is_refused(checkpoint, tmp_path, edit, message):
    copy_with(checkpoint, tmp_path, config_edit=edit)
    with pytest.raises(ConfigError, match=message):
        lookm_jax.load(str(tmp_path))


def test_absent_token_ids_take_hf_llama_defaults(checkpoint, tmp_path):
    """llava-1.5's hub text_config omits eos/bos: HF's LlamaConfig then stops at 2; an explicit null stays none."""
    copy_with(checkpoint, tmp_path, config_edit=lambda c: [c["text_config"].pop(k, None) for k in ("eos_token_id",
                                                                                                    "bos_token_id")])
    config, hf = lookm_jax.load(str(tmp_path)).text_config, transformers.LlamaConfig()
    assert config.eos_token_ids == (hf.eos_token_id,) and config.bos_token_id == hf.bos_token_id
    assert lookm_jax.load(str(checkpoint)).text_config.eos_token_ids == ()  # saved as null by transformers 5


def test_converted_round_trip(checkpoint, tmp_path):
    model = lookm_jax.load(str(checkpoint))
    model.save(str(tmp_path / "converted"))
    again = lookm_jax.load(str(tmp_path / "converted"))
    assert again.config == model.config
    assert_same_params(model, again)
    ids = np.asarray([[3, 4, 5]], np.int32)
    np.testing.assert_array_equal(again.logits(ids), model.logits(ids))


def test_interrupted_save_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    model = lookm_jax.load(str(checkpoint))
    target = tmp_path / "converted"

    def fail(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. the user hits Ctrl-C while the params are written

    monkeypatch.setattr(store, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        model.save(str(target))
    assert os.listdir(tmp_path) == []  # neither the target nor a temporary folder remains


def test_corrupt_converted_folder(checkpoint, tmp_path):
    lookm_jax.load(str(checkpoint)).save(str(tmp_path / "c"))
    (tmp_path / "c" / store.PARAMS).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt or missing params.safetensors"):
        lookm_jax.load(str(tmp_path / "c"))


def test_malformed_json_files_are_named(checkpoint, tmp_path):
    """config.json, the shard index, tokenizer.json and a converted folder's manifest: each malformed
    file is named in a CheckpointError (a ValueError: the CLI's one line), never a bare traceback."""
    copy_with(checkpoint, tmp_path / "list", config_edit=lambda c: None)
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    copy_with(checkpoint, tmp_path / "cut", shards=2)
    (tmp_path / "cut" / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    copy_with(checkpoint, tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": 1}')
    for name, message in (("list", "config.json: must hold a JSON object, got a list"),
                          ("cut", "model.safetensors.index.json: not a readable JSON file"),
                          ("tok", "tokenizer.json is not a tokenizers file")):
        with pytest.raises(CheckpointError, match=message):
            lookm_jax.load(str(tmp_path / name))
    lookm_jax.load(str(checkpoint)).save(str(tmp_path / "c"))
    manifest = json.loads((tmp_path / "c" / store.MANIFEST).read_text())
    del manifest["hf_config"]
    (tmp_path / "c" / store.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="has no hf_config object"):
        lookm_jax.load(str(tmp_path / "c"))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["text_config"].update(num_hidden_layers=3), r"text\.layers\.attn_norm has shape \(2, 48\).* \(3, 48\)"),
    (lambda c: c["text_config"].update(hidden_size=64), r"text\.embed has shape \(251, 48\).* \(251, 64\)"),
    (lambda c: c["text_config"].update(vocab_size=300), r"text\.embed has shape \(251, 48\).* \(300, 48\)"),
    (lambda c: c["vision_config"].update(num_hidden_layers=2), r"vision\.layers\.\w+ has shape \(3, .* \(2, "),
    (lambda c: c.update(multimodal_projector_bias=False), r"projector\.b1 has shape \(48,\).* no such parameter"),
])
def test_converted_folder_whose_config_disagrees_with_its_params_is_refused(checkpoint, tmp_path, monkeypatch,
                                                                              edit, message):
    """Checked from the params file's header, before the params are read: one error naming the first
    parameter that differs, its shape and the config's."""
    lookm_jax.load(str(checkpoint)).save(str(tmp_path / "c"))
    manifest = json.loads((tmp_path / "c" / store.MANIFEST).read_text())
    edit(manifest["hf_config"])
    (tmp_path / "c" / store.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(safetensors_io.FileTensor, "read", lambda self: pytest.fail("the params were read before the check"))
    folder = re.escape(str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match=rf"^{folder}: parameter {message}.*convert the checkpoint again"):
        lookm_jax.load(str(tmp_path / "c"))


def test_converted_folder_missing_a_parameter_is_refused(checkpoint, tmp_path):
    lookm_jax.load(str(checkpoint)).save(str(tmp_path / "c"))
    params = load_file(str(tmp_path / "c" / store.PARAMS))
    del params["text.final_norm"]
    save_file(params, str(tmp_path / "c" / store.PARAMS))
    with pytest.raises(CheckpointError, match=r"parameter text\.final_norm has shape none \(absent\).* \(48,\)"):
        lookm_jax.load(str(tmp_path / "c"))


def test_plain_llama_survives_save(tmp_path):
    """A text-only checkpoint's converted folder passes the shape check (as the llava, InternViT, InternVL,
    MobileVLM and demo ones do in their tests)."""
    lm, config = tiny_llama()
    save_checkpoint(tmp_path / "hf", lm.state_dict(), {**config, "model_type": "llama"})
    model = lookm_jax.load(str(tmp_path / "hf"))
    model.save(str(tmp_path / "c"))
    assert_same_params(model, lookm_jax.load(str(tmp_path / "c")))


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)],
                         ids=["umask022", "umask027"])
def test_converted_folders_get_the_umasks_modes(tmp_path, monkeypatch, umask, folder_mode, file_mode):
    """Not mkdtemp's 0700 and safetensors' 0600: installs sharing a cache share the demo. Saved
    directly (into missing parent folders) and as the demo cache."""
    monkeypatch.setenv("LOOKM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "build_demo", lambda path=None: ({"hf_config": {}}, {"text": {"w": np.ones(3)}}, "{}"))
    old = os.umask(umask)
    try:
        store.save_converted(str(tmp_path / "new" / "c"), {"text": {"w": np.ones(3)}}, {"hf_config": {}}, "{}")
        loading._build_demo_cache("unused.gguf", str(tmp_path / "cache" / "demo"))
    finally:
        os.umask(old)
    for folder in (tmp_path / "new" / "c", tmp_path / "cache" / "demo"):
        modes = {name: stat.S_IMODE(os.stat(folder / name).st_mode) for name in os.listdir(folder)}
        assert modes == dict.fromkeys([store.MANIFEST, store.PARAMS, store.TOKENIZER], file_mode), folder
        assert stat.S_IMODE(os.stat(folder).st_mode) == stat.S_IMODE(os.stat(folder.parent).st_mode) == folder_mode
    assert os.listdir(tmp_path / "new") == ["c"] and os.listdir(tmp_path / "cache") == ["demo"]


def test_save_refuses_a_destination_it_cannot_write_before_writing(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    for dst in (tmp_path / "file.txt" / "c", tmp_path / "file.txt" / "deeper" / "c"):
        with pytest.raises(InputError, match=rf"^{re.escape(str(dst))}: cannot write there \("
                                             rf"{re.escape(str(tmp_path / 'file.txt'))} is not a folder"):
            store.save_converted(str(dst), {"text": {"w": np.ones(3)}}, {"hf_config": {}})
    if os.path.isdir("/proc"):  # where even root creates nothing (the write test, not access(), sees it)
        with pytest.raises(InputError, match=r"^/proc/c: cannot write there \(/proc is not a folder"):
            store.save_converted("/proc/c", {"text": {"w": np.ones(3)}}, {"hf_config": {}})
    assert os.listdir(tmp_path) == ["file.txt"]


def test_save_converted_handles_strided_arrays(tmp_path):
    """Transposed views (what the mapping tables produce) must be written in their logical order."""
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    params = {"text": {"w": weight.T, "stacked": np.stack([weight.T, weight.T + 1])}}
    store.save_converted(str(tmp_path / "c"), params, {"hf_config": {}})
    loaded = store.unflatten(load_file(str(tmp_path / "c" / store.PARAMS)))  # no config: load_converted refuses it
    np.testing.assert_array_equal(loaded["text"]["w"], weight.T)
    np.testing.assert_array_equal(loaded["text"]["stacked"], np.stack([weight.T, weight.T + 1]))


def test_runtime_path_imports_neither_torch_nor_transformers(checkpoint):
    """Load + convert + preprocess + generate in a fresh interpreter: torch/transformers stay unimported."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, lookm_jax\n"
        "from lookm_jax.models.image_processing import CLIPImageProcessorConfig, preprocess_images\n"
        f"m = lookm_jax.load({str(checkpoint)!r})\n"
        "px = preprocess_images([np.zeros((40, 50, 3), np.uint8)], CLIPImageProcessorConfig.from_hf_dict("
        "{'size': {'shortest_edge': 30}, 'crop_size': {'height': 30, 'width': 30}}))\n"
        "ids = np.array([[3] + [m.config.image_token_id] * m.config.image_seq_length + [4]])\n"
        "m.generate(ids, px, max_new_tokens=2)\n"
        "print(sorted(k for k in ('torch', 'transformers') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_runtime_layout_round_trips_and_keeps_each_heads_projection():
    """`llama.runtime_params` fuses q/k/v per KV head and gate/up per row; `stored_params` undoes
    it exactly (Qwen2 biases and GQA included), and row j of a query head's block in w_qkv is the
    stored wq's column of that head."""
    from lookm_jax.convert.tables import llama_shapes
    from lookm_jax.models import llama
    from lookm_jax.models.config import LlamaConfig, RopeConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5, rope=RopeConfig(theta=1e4), qkv_bias=True)
    rng = np.random.default_rng(0)
    stored = {"layers": {}}
    for path, shape in llama_shapes(cfg).items():
        leaf = rng.standard_normal(shape).astype(np.float32)
        (stored["layers"] if path.startswith("layers.") else stored)[path.split(".")[-1]] = leaf
    assert {"bq", "bk", "bv"} <= set(stored["layers"])
    runtime = llama.runtime_params(cfg, stored)
    layer = runtime["layers"][1]
    assert layer["w_qkv"].shape == (2, 3 + 2, 4, 24) and layer["w_gate_up"].shape == (40, 2, 24)
    head = 4  # query head 4 belongs to KV head 1 (3 query heads per KV head), second in its group
    np.testing.assert_array_equal(layer["w_qkv"][1, 1], stored["layers"]["wq"][1][:, head * 4:(head + 1) * 4].T)
    np.testing.assert_array_equal(layer["w_qkv"][1, 3], stored["layers"]["wk"][1][:, 4:8].T)
    back = llama.stored_params(cfg, runtime)
    assert set(back["layers"]) == set(stored["layers"])
    for name, value in stored["layers"].items():
        np.testing.assert_array_equal(back["layers"][name], value, err_msg=name)


def test_streamed_runtime_layout_equals_runtime_params(tmp_path):
    """Loading builds the decoder's runtime layout tensor by tensor from a converted folder's stored
    layers (`convert.runtime`): the same arrays as `llama.runtime_params` on the whole stacked tree."""
    from lookm_jax.convert import runtime
    from lookm_jax.convert.tables import llama_shapes
    from lookm_jax.models import llama
    from lookm_jax.models.config import LlamaConfig, RopeConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=6,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5, rope=RopeConfig(theta=1e4), qkv_bias=True)
    rng = np.random.default_rng(1)
    stored = store.unflatten({path: rng.standard_normal(shape).astype(np.float32)
                              for path, shape in llama_shapes(cfg).items()})
    store.save_file(store.flatten(stored), str(tmp_path / "p.safetensors"))
    handles = safetensors_io.read_header(str(tmp_path / "p.safetensors"))
    placed = []
    streamed = runtime.text_params(cfg, runtime.stored_jobs(handles, cfg.num_layers), np.float32,
                                   lambda path, a: placed.append(path) or a)
    whole = llama.runtime_params(cfg, stored)
    assert jax.tree.structure(streamed) == jax.tree.structure(whole)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(streamed)[0], jax.tree.leaves(whole)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    assert len(placed) == len(set(placed)) == len(jax.tree.leaves(whole)) and "text.layers.2.w_qkv" in placed

"""Adapters that act on image tokens only (partial LoRA, `--adapted-tokens image`): trained on the fly
and shipped unfolded, they change what a prompt with pictures computes and leave every text token,
so every text-only prompt and every decode step, to the plain weights exactly."""

from __future__ import annotations

import contextlib
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lookm_jax
from lookm_jax.model import forward_logits
from lookm_jax.models import llama, llava
from lookm_jax.train import adapters as lora
from lookm_jax.train import decoder
from tests.test_train import _fixed_batch, tiny  # noqa: F401  (the tiny tied LLaVA fixture)
from tests.test_train_decoder import _random_adapters


def _with_image_adapters(model, ad):
    """`model` with `ad` as its image adapters, as `loading.build_demo` gives a model an image-only run's."""
    import dataclasses

    rank = int(ad[0]["w_qkv"]["a"].shape[0])
    config = dataclasses.replace(model.config, image_adapter_rank=rank)
    manifest = {**model.manifest, "hf_config": {**model.manifest["hf_config"], "image_adapter_rank": rank}}
    params = {**model.params, "image_adapters": jax.tree.map(jnp.asarray, lora.stacked(ad))}
    return dataclasses.replace(model, config=config, params=params, manifest=manifest, _compiled={})


def test_dense_adds_the_update_at_the_marked_tokens_only():
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32), jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    adapter = {"a": jnp.asarray(rng.normal(size=(3, 6)), jnp.float32), "b": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    tokens = jnp.asarray([[1, 0, 0, 1, 1], [0, 0, 1, 0, 0]], bool)
    gated = np.asarray(llama.dense(x, w, adapter={**adapter, "tokens": tokens}))
    plain, full = np.asarray(llama.dense(x, w)), np.asarray(llama.dense(x, w, adapter=adapter))
    marked = np.asarray(tokens)
    np.testing.assert_array_equal(gated[~marked], plain[~marked])
    np.testing.assert_array_equal(gated[marked], full[marked])
    assert np.abs(full - plain).max() > 0.1


def test_shipped_image_adapters_compute_what_training_applied_and_leave_text_alone(tiny):
    """The model's forward (`with_image_adapters` on attached adapters) equals the trainer's on-the-fly
    path (`adapters.apply` at the image tokens); a text-only prompt's logits are the plain model's exactly."""
    ad = _random_adapters(tiny.params["text"])
    adapted = _with_image_adapters(tiny, ad)
    batch = _fixed_batch(tiny)
    ids, valid, pixels = (jnp.asarray(a) for a in (batch.ids, batch.valid, batch.pixel_values))
    shipped = forward_logits(tiny.config, adapted.params, ids, valid, pixels)
    x, is_image = llava.embed(tiny.config, tiny.params, ids, pixels)
    trained = lora.apply(tiny.params["text"], ad, 1.0, is_image)
    on_the_fly = llama.lm_logits(trained, llama.forward(tiny.config.text, trained, x, valid))
    error = float(jnp.abs(shipped - on_the_fly).max())  # compiled against eager fp32
    assert error <= 1e-5 * float(jnp.abs(on_the_fly).max()), error  # the ports' bar: 1e-5 of the logits' scale
    plain = forward_logits(tiny.config, tiny.params, ids, valid, pixels)
    after_pictures = ~np.asarray(is_image) & (np.cumsum(np.asarray(is_image), axis=1) > 0)
    assert np.abs(np.asarray(shipped - plain))[after_pictures].max() > 1e-2  # text reads the adapted pictures
    text_only = jnp.asarray(np.random.default_rng(1).integers(0, 200, (2, 12)), jnp.int32)
    ones = jnp.ones(text_only.shape, bool)
    np.testing.assert_array_equal(forward_logits(tiny.config, adapted.params, text_only, ones, None),
                                  forward_logits(tiny.config, tiny.params, text_only, ones, None))


def test_image_adapters_generate_text_with_the_plain_weights_and_survive_save_and_load(tiny, tmp_path):
    ad = _random_adapters(tiny.params["text"])
    adapted = _with_image_adapters(tiny, ad)
    text_only = np.random.default_rng(2).integers(0, 200, (2, 9)).astype(np.int32)
    np.testing.assert_array_equal(adapted.generate(text_only, max_new_tokens=6), tiny.generate(text_only, max_new_tokens=6))
    batch = _fixed_batch(tiny)
    with_pictures = adapted.generate(batch.ids, batch.pixel_values, max_new_tokens=6)
    adapted.save(str(tmp_path / "saved"))
    loaded = lookm_jax.load(str(tmp_path / "saved"))
    chex.assert_trees_all_equal(jax.device_get(loaded.params["image_adapters"]),
                                jax.device_get(adapted.params["image_adapters"]))
    np.testing.assert_array_equal(loaded.generate(batch.ids, batch.pixel_values, max_new_tokens=6), with_pictures)


def test_image_only_training_fits_the_image_tokens_and_needs_no_replay(tiny, tmp_path):
    with pytest.raises(ValueError, match="replay_weight and replay_generated must be 0"):
        decoder.DecoderConfig(adapted_tokens="image")
    with pytest.raises(ValueError, match="adapted_tokens must be one of"):
        decoder.DecoderConfig(adapted_tokens="text")
    config = decoder.DecoderConfig(steps=30, rank=4, learning_rate=1e-2, projector_learning_rate=0.0, warmup_steps=2,
                                   checkpoint_every=10, replay_weight=0.0, image_norm_weight=0.0, adapted_tokens="image")
    batch = _fixed_batch(tiny)  # its targets are read at image positions
    trained = decoder.train(tiny, config, str(tmp_path), batch_fn=lambda step: batch, progress=False)
    records = [json.loads(line) for line in open(tmp_path / decoder.LOG)]
    assert "replay_kl" not in records[0]
    assert records[-1]["loss"] < 0.5 * records[0]["loss"], (records[0]["loss"], records[-1]["loss"])
    assert any(float(np.abs(ad["b"]).max()) > 0 for layer in trained["adapters"] for ad in layer.values())


def test_the_demo_attaches_image_only_adapters_instead_of_folding_them(tmp_path):
    from lookm_jax import loading

    frozen = loading.demo_model(decoder="frozen")
    ad = jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.float32), _random_adapters(frozen.params["text"]))
    path = str(tmp_path / "adapters.safetensors")
    decoder.export_adapters(path, ad, 1.0, {"adapted_tokens": "image"})
    assert loading.demo_adapters_tokens(path) == "image"
    odd = str(tmp_path / "odd.safetensors")
    decoder.export_adapters(odd, ad, 1.0, {"adapted_tokens": "text"})
    with pytest.raises(ValueError, match=r"adapted_tokens 'text' in its metadata, expected one of \('all', 'image'\)"):
        loading.demo_model(decoder=odd)
    demo = loading.demo_model(decoder=path)
    chex.assert_trees_all_equal(demo.params["text"]["layers"][0]["wo"], frozen.params["text"]["layers"][0]["wo"])
    assert demo.config.image_adapter_rank == 3
    chex.assert_trees_all_close(jax.device_get(demo.params["image_adapters"]), lora.stacked(ad))
    paris = demo.encode_chat("What is the capital of France?")
    np.testing.assert_array_equal(demo.generate(paris, max_new_tokens=8), frozen.generate(paris, max_new_tokens=8))


def test_decoder_command_adapted_tokens_flag(tmp_path, capsys):
    from lookm_jax import cli
    from lookm_jax.train.decoder_command import decoder_config

    def config(*flags):
        return decoder_config(cli.build_parser().parse_args(["train", "decoder", "--output", "run", *flags]))

    assert (config().adapted_tokens, config().replay_weight) == ("all", 1.0)
    image = config("--adapted-tokens", "image")
    assert (image.adapted_tokens, image.replay_weight) == ("image", 0.0)
    assert config("--adapted-tokens", "image", "--replay-weight", "0").replay_weight == 0.0
    out = tmp_path / "run"
    for flags, message in ((("--adapted-tokens", "image", "--replay-weight", "1"), "--replay-weight and --replay-generated must be 0"),
                           (("--adapted-tokens", "text"), "argument --adapted-tokens: invalid choice")):
        with pytest.raises(SystemExit) if "argument" in message else contextlib.nullcontext():
            assert cli.main(["train", "decoder", "--output", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()

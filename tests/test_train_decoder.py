"""Stage 2 (lookm_jax.train.decoder): adapters learn on a fixed batch, a killed run resumes exactly,
folded adapters equal adapters applied on the fly, replay batches reproduce the frozen decoder, and
the exported adapters read back and fold into the demo's weights."""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookm_jax.models import llama, llava
from lookm_jax.train import adapters as lora
from lookm_jax.train import decoder, replay
from tests.test_train import _fixed_batch, tiny  # noqa: F401  (the tiny tied LLaVA fixture)


def _bank(model, rows: int = 6, prompt: int = 9, answer: int = 5) -> replay.Bank:
    """Random prompts with the model's own greedy continuation (what `replay.make_bank` makes)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 200, (1, prompt)).astype(np.int32) for _ in range(rows)]
    tokens = model.generate(np.concatenate(prompts), max_new_tokens=answer)
    return replay.Bank(tuple(f"p{i}" for i in range(rows)), tuple(tuple(int(t) for t in p[0]) for p in prompts),
                       tuple(tuple(int(t) for t in row) for row in np.asarray(tokens)))


def _config(steps: int, **overrides) -> decoder.DecoderConfig:
    settings = dict(steps=steps, rank=4, learning_rate=1e-2, projector_learning_rate=0.0, warmup_steps=2,
                    checkpoint_every=3, replay_batch_size=2, replay_weight=0.1, image_norm_weight=0.0)
    return decoder.DecoderConfig(**(settings | overrides))


def _train(model, config, folder, stop_after=None):
    batch, bank = _fixed_batch(model), _bank(model)
    return decoder.train(model, config, str(folder), batch_fn=lambda step: batch, replay_bank=bank,
                         stop_after=stop_after, progress=False)


def test_adapters_alone_halve_the_loss_on_a_fixed_batch(tiny, tmp_path):
    """The projector frozen (rate 0): only the decoder's adapters move, and they fit the batch."""
    trained = _train(tiny, _config(30), tmp_path)
    records = [json.loads(line) for line in open(tmp_path / decoder.LOG)]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[-1]["loss"] < 0.5 * records[0]["loss"], (records[0]["loss"], records[-1]["loss"])
    chex.assert_trees_all_equal(trained["projector"], jax.device_get(tiny.params["projector"]))
    assert any(float(np.abs(ad["b"]).max()) > 0 for layer in trained["adapters"] for ad in layer.values())


def test_killed_and_resumed_run_equals_an_uninterrupted_one(tiny, tmp_path):
    config = _config(7, projector_learning_rate=1e-3)
    whole = _train(tiny, config, tmp_path / "whole")
    _train(tiny, config, tmp_path / "killed", stop_after=4)  # checkpoint at 3 and 4 (the call's last)
    with open(tmp_path / "killed" / decoder.LOG, "a") as log:
        log.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')  # a kill mid-write after step 4
    chex.assert_trees_all_equal(_train(tiny, config, tmp_path / "killed"), whole)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "killed" / decoder.LOG)]
    assert steps == list(range(1, 8))
    with pytest.raises(ValueError, match=r"other settings \(rank: 4 -> 8"):
        _train(tiny, dataclasses.replace(config, rank=8), tmp_path / "killed")


def test_a_loss_that_turns_nan_stops_before_its_checkpoint(tiny, tmp_path):
    batch, bank = _fixed_batch(tiny), _bank(tiny)
    poisoned = dataclasses.replace(batch, pixel_values=np.full_like(batch.pixel_values, np.nan))
    with pytest.raises(ValueError, match="stage-2 loss became nan at step 2"):
        decoder.train(tiny, _config(5, checkpoint_every=1), str(tmp_path), replay_bank=bank, progress=False,
                      batch_fn=lambda step: poisoned if step == 2 else batch)
    assert [json.loads(line)["step"] for line in open(tmp_path / decoder.LOG)] == [1]


def _random_adapters(text_params: dict, seed: int = 3) -> lora.Adapters:
    """Adapters with b nonzero (a fresh init has b = 0, which would make any fold look right)."""
    made = lora.init(text_params, rank=3, seed=seed)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.05, x.shape), jnp.float32), made)


def test_folded_adapters_give_the_logits_of_adapters_applied_on_the_fly(tiny):
    text = tiny.params["text"]
    ad = _random_adapters(text)
    batch = _fixed_batch(tiny)
    x, _ = llava.embed(tiny.config, tiny.params, jnp.asarray(batch.ids), jnp.asarray(batch.pixel_values))
    valid = jnp.asarray(batch.valid)

    def logits(params):
        return llama.lm_logits(params, llama.forward(tiny.config.text, params, x, valid))

    on_the_fly, folded, plain = logits(lora.apply(text, ad, 1.5)), logits(lora.fold(text, ad, 1.5)), logits(text)
    chex.assert_trees_all_close(folded, on_the_fly, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(on_the_fly - plain).max()) > 1e-2  # the adapters do change the function


def test_replay_batch_targets_are_the_frozen_decoders_greedy_tokens(tiny):
    """A replay batch read by the untrained (b = 0) adapted decoder predicts every target token: the
    batch puts each continuation where the frozen decoder produced it."""
    bank = _bank(tiny)
    batch = jax.tree.map(jnp.asarray, decoder.replay_batch(bank, range(6), length=16))
    trainable = {"adapters": lora.init(tiny.params["text"], 2, 0), "projector": tiny.params["projector"]}
    accuracy = decoder._replay_token_accuracy(tiny.config, 1.0)(trainable, {"text": tiny.params["text"]}, batch)
    assert float(accuracy) == 1.0
    shifted = {**batch, "targets": jnp.roll(batch["targets"], 1, axis=1)}  # a batch off by one fails
    assert float(decoder._replay_token_accuracy(tiny.config, 1.0)(trainable, {"text": tiny.params["text"]},
                                                                  shifted)) < 0.9


def test_replay_agreement_counts_positions_and_pads_stopped_rows():
    assert replay.agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert replay.agreement([[1, 2, 9]], [[1, 2, 3] + [5] * 29]) == pytest.approx(2 / 32)
    assert not set(replay.prompts("train", 0)) & set(replay.prompts("heldout", 0))
    assert len(replay.prompts("heldout", 0)) >= 100


def test_exported_adapters_read_back_and_refuse_the_wrong_decoder(tiny, tmp_path):
    from lookm_jax import loading

    ad = _random_adapters(tiny.params["text"])
    path = str(tmp_path / "adapters.safetensors")
    decoder.export_adapters(path, ad, 2.0, {"note": "test"})
    read = loading.read_demo_adapters(path, tiny.params["text"])
    expected = lora.fold(tiny.params["text"], ad, 2.0)
    got = lora.fold(tiny.params["text"], read, 1.0)  # exported b carries the scale
    chex.assert_trees_all_close(got, expected, atol=1e-4)  # float16 storage
    fewer = {**tiny.params["text"], "layers": tiny.params["text"]["layers"][:1]}
    with pytest.raises(ValueError, match="do not match the decoder's 1 layers"):
        loading.read_demo_adapters(path, fewer)


def test_stage_two_batches_cover_every_picture_kind_and_fit_their_static_shapes(tiny):
    """The default batch kinds' samples fit their lengths and target counts, ask every kind of
    `scenes.PICTURE_KINDS` and a text fact, and an unknown kind is refused."""
    from lookm_jax import loading, scenes
    from lookm_jax.train.data import BatchSpec, Encoder, multi_picture_conversation

    demo = loading.demo_model(decoder="frozen")
    encoder = Encoder.of(demo)
    asked = set()
    for spec in decoder.DEFAULT_BATCHES[1:4]:
        for i in range(24):
            sample = scenes.multi_picture_sample("train", 0, i, spec.picture_count("train", 0, i), spec.turns,
                                                 spec.kinds, text_fact=spec.text_facts)
            ids, role = encoder.conversation(multi_picture_conversation(sample))
            assert len(ids) <= spec.length and sum(1 for r in role if r) <= spec.max_targets
            asked |= {q.kind for q in sample.questions}
    assert asked == set(scenes.PICTURE_KINDS) | {"text_fact"}
    with pytest.raises(ValueError, match="unknown question kinds"):
        BatchSpec(batch_size=1, pictures=2, turns=1, length=8, max_targets=2, kinds=("colour_of_sky",))


def test_the_demo_built_with_adapters_folded_equals_them_applied_on_the_fly(tmp_path):
    """`build_demo(decoder=FILE)` folds a run's exported adapters into the stored weights: its logits
    equal the frozen demo's with the same adapters applied on the fly."""
    from lookm_jax import loading

    frozen = loading.demo_model(decoder="frozen")
    ad = jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.float32),  # as exported: float16
                      _random_adapters(frozen.params["text"]))
    path = str(tmp_path / "adapters.safetensors")
    decoder.export_adapters(path, ad, 1.0, {})
    folded = loading.demo_model(decoder=path)
    assert folded.manifest["decoder"] == path
    ids = jnp.asarray(frozen.encode_chat("What is the capital of France?"))
    valid = jnp.ones(ids.shape, bool)

    def logits(text):
        x = llama.embed_tokens(text, ids)
        return llama.lm_logits(text, llama.forward(frozen.text_config, text, x, valid))

    on_the_fly = logits(lora.apply(frozen.params["text"], ad, 1.0))
    error = float(jnp.abs(logits(folded.params["text"]) - on_the_fly).max())
    assert error <= 1e-5 * float(jnp.abs(on_the_fly).max()), error  # the ports' bar: 1e-5 of the logits' scale
    assert float(jnp.abs(on_the_fly - logits(frozen.params["text"])).max()) > 1e-2


def test_a_run_started_from_an_exported_run_starts_where_it_ended(tiny, tmp_path):
    """`DecoderConfig.init`: a finished run's exported adapters (b unscaled) and projector are the new
    run's starting point; an init of another rank, or over another tower, is refused."""
    import types

    from lookm_jax.train import vision

    config = _config(3, projector_learning_rate=1e-3)
    first = tmp_path / "first"
    trained = _train(tiny, config, first)
    decoder.export_adapters(str(first / decoder.ADAPTERS_FILE), trained["adapters"], config.scale, {})
    vision.export_weights(str(first / decoder.VISION_FILE),
                          {"vision": jax.device_get(tiny.params["vision"]), "projector": trained["projector"]}, {})
    start = decoder.initial_trainable(tiny, dataclasses.replace(config, init=str(first)))
    chex.assert_trees_all_close(start["adapters"], trained["adapters"], rtol=1e-3, atol=1e-6)  # float16 storage
    chex.assert_trees_all_equal(jax.device_get(start["projector"]), trained["projector"])
    with pytest.raises(ValueError, match="its adapters have rank 4, this run's rank is 8"):
        decoder.initial_trainable(tiny, dataclasses.replace(config, init=str(first), rank=8))
    other_tower = types.SimpleNamespace(params={**tiny.params, "vision": jax.tree.map(lambda x: x + 1, tiny.params["vision"])})
    with pytest.raises(ValueError, match="trained over another tower"):
        decoder.initial_trainable(other_tower, dataclasses.replace(config, init=str(first)))


def test_kind_weights_draw_multi_picture_kinds_in_proportion():
    from collections import Counter

    from lookm_jax import scenes

    batches = decoder.weighted_batches({"which_picture": 3})
    assert batches[0] == decoder.DEFAULT_BATCHES[0]  # single pictures: no kinds to weigh
    assert all(s.kinds.count("which_picture") == 3 and s.kinds.count("picture_colour") == 1 for s in batches[1:])
    drawn = Counter(q.kind for i in range(200)
                    for q in scenes.multi_picture_sample("train", 0, i, 8, 1, batches[2].kinds).questions)
    assert drawn["which_picture"] > 2 * drawn["picture_colour"], drawn
    with pytest.raises(ValueError, match="unknown question kind 'which'"):
        decoder.weighted_batches({"which": 2})
    with pytest.raises(ValueError, match="must be a whole number >= 1, got 0"):
        decoder.weighted_batches({"which_picture": 0})

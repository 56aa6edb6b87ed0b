"""Stage 2 (lookm_jax.train.decoder): adapters learn on a fixed batch, a killed run resumes exactly,
folded adapters equal adapters applied on the fly, replay batches reproduce the frozen decoder, and
the exported adapters read back and fold into the demo's weights."""

from __future__ import annotations

import contextlib
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
from tests.conftest import IMAGE_TOKEN, tiny_llava
from tests.test_train import _fixed_batch, tiny  # noqa: F401  (the tiny tied LLaVA fixture)


def _bank(model, rows: int = 6, prompt: int = 9, answer: int = 5, seed: int = 1) -> replay.Bank:
    """Random prompts with the model's own greedy continuation (what `replay.make_bank` makes)."""
    rng = np.random.default_rng(seed)
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


def test_replay_rows_draw_half_from_the_generated_prompts_only_when_there_are_some():
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows = decoder.replay_rows(rng, 170, 8, 4)  # 162 templated + 8 generated
        assert len(set(rows)) == 4 and sum(rows < 162) == 2 and rows.max() < 170
        assert len(set(decoder.replay_rows(rng, 6, 0, 4))) == 4
    assert sum(decoder.replay_rows(rng, 170, 8, 5) >= 162) == 2
    for size, generated in ((1, 5), (4, 1)):  # a step's generated rows would be none, or more than there are
        with pytest.raises(ValueError, match="replay_generated > 0 needs replay_batch_size >= 2"):
            _config(3, replay_batch_size=size, replay_generated=generated)
    with pytest.raises(ValueError, match="replay_generated must be >= 0, got -1"):
        _config(3, replay_generated=-1)


def test_replay_agreement_counts_positions_and_pads_stopped_rows():
    assert replay.agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert replay.agreement([[1, 2, 9]], [[1, 2, 3] + [5] * 29]) == pytest.approx(2 / 32)
    assert not set(replay.prompts("train", 0)) & set(replay.prompts("heldout", 0))
    assert len(replay.prompts("heldout", 0)) >= 100


def test_forced_divergence_reads_each_token_after_the_reference_s_own_prefix(tiny):
    """Against its own greedy continuations a model agrees on every token; a changed model's forced agreement
    is the trainer's teacher-forced replay accuracy (the same adapters applied on the fly, tokens pooled), and
    where it first differs the reference preferred its own token (its greedy choice) by a gap >= 0."""
    bank = _bank(tiny, rows=4, answer=8)
    bank = dataclasses.replace(bank, continuations=(bank.continuations[0][:3],) + bank.continuations[1:])  # uneven
    ids = [np.asarray([p], np.int32) for p in bank.prompt_ids]
    reference = [list(t) for t in bank.continuations]
    assert replay.forced_divergence(tiny, tiny, ids, reference) == {"forced_agreement": 1.0, "gap_at_divergence": None}
    text, adapters, scale = tiny.params["text"], _random_adapters(tiny.params["text"]), 30.0
    changed = dataclasses.replace(tiny, params={**tiny.params, "text": lora.fold(text, adapters, scale)}, _compiled={})
    moved = replay.forced_divergence(tiny, changed, ids, reference)
    batch = jax.tree.map(jnp.asarray, decoder.replay_batch(bank, range(4), length=24))
    on_the_fly = decoder._replay_token_accuracy(tiny.config, scale)({"adapters": adapters}, {"text": text}, batch)
    assert moved["forced_agreement"] == pytest.approx(float(on_the_fly), abs=1e-6), moved
    assert moved["forced_agreement"] < 1.0 and moved["gap_at_divergence"] >= 0.0, moved


def test_generated_replay_prompts_are_the_models_own_distinct_user_turns(demo, tiny, tmp_path, monkeypatch):
    """Magpie's recipe on the demo: distinct, seeded user turns, none a held-out prompt; the train bank
    holds the templates then them, and is read back on resume only for the same count."""
    from lookm_jax.models.processors import IMAGE_MARKER

    monkeypatch.setattr(replay, "GENERATION_BATCH", 8)
    first = replay.generated_prompts(demo, 5, seed=3)
    assert len(first) == len(set(first)) == 5 and all(p and IMAGE_MARKER not in p for p in first)
    assert replay.generated_prompts(demo, 5, seed=3) == first
    assert replay.generated_prompts(demo, 5, seed=4) != first
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=r"in 3 batches of 8, fewer than the 20 asked"):
        patch.setattr(replay, "GENERATION_DRAWS", 1)  # a batch of 8 for every 8 asked: too few usable turns
        replay.generated_prompts(demo, 20, seed=3)
    with pytest.raises(ValueError, match="need a model with a chat template"):
        replay.generated_prompts(tiny, 2, seed=3)
    templated = {"train": ("Name a colour.",), "heldout": (first[0].upper(),)}  # a held-out prompt is never drawn
    monkeypatch.setattr(replay, "prompts", lambda split, seed: templated[split])
    assert first[0] not in replay.generated_prompts(demo, 5, seed=3)
    bank = replay.bank(demo, str(tmp_path), "train", 3, generated=2)
    assert bank.prompts[0] == "Name a colour." and len(bank.prompts) == 3 and len(bank.continuations) == 3
    monkeypatch.setattr(replay, "make_bank", lambda *args: pytest.fail("a saved bank was made again"))
    assert replay.bank(demo, str(tmp_path), "train", 3, generated=2) == bank
    with pytest.raises(pytest.fail.Exception):
        replay.bank(demo, str(tmp_path), "train", 3, generated=1)


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
    asked, listed, tallied = set(), 0, 0
    forms = [decoder.with_count_form(form)[1:4] for form in ("listed", "tallied")]
    for spec in decoder.DEFAULT_BATCHES[1:4] + forms[0] + forms[1]:
        for i in range(24):
            sample = scenes.multi_picture_sample("train", 0, i, spec.picture_count("train", 0, i), spec.turns,
                                                 spec.kinds, text_fact=spec.text_facts)
            conversation = multi_picture_conversation(sample, spec.count_form)
            ids, role = encoder.conversation(conversation)
            assert len(ids) <= spec.length and sum(1 for r in role if r) <= spec.max_targets
            asked |= {q.kind for q in sample.questions}
            listed += spec.count_form == "listed" and sum(a[0].isdigit() or a.startswith("None:") for _, a in conversation)
            tallied += spec.count_form == "tallied" and sum(a.startswith("1 ") for _, a in conversation)
    assert asked == set(scenes.PICTURE_KINDS) | {"text_fact"} and listed > 0 and tallied > 0
    assert decoder.with_count_form("tallied")[0] == decoder.DEFAULT_BATCHES[0]  # single pictures unchanged
    with pytest.raises(ValueError, match="count form must be one of"):
        decoder.with_count_form("spelled")
    with pytest.raises(ValueError, match="not with a count_pictures kind weight"):
        decoder.with_count_form("tallied", decoder.weighted_batches({"count_pictures": 2}))
    with pytest.raises(ValueError, match="count_form must be one of"):
        BatchSpec(batch_size=1, pictures=2, turns=1, length=8, max_targets=2, count_form="spelled")
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


def test_adapters_at_rate_zero_stay_the_scaled_init_while_the_projector_trains(tiny, tmp_path):
    """`learning_rate=0` with `init_scale`: the init's adapters, b scaled, are the run's throughout (so
    text-only answers cannot move) and only the projector learns; a config that trains nothing, or scales
    adapters without an init, is refused."""
    from lookm_jax.train import vision

    first = tmp_path / "first"
    trained = _train(tiny, _config(3), first)
    decoder.export_adapters(str(first / decoder.ADAPTERS_FILE), trained["adapters"], 2.0, {})
    vision.export_weights(str(first / decoder.VISION_FILE),
                          {"vision": jax.device_get(tiny.params["vision"]), "projector": trained["projector"]}, {})
    config = _config(4, learning_rate=0.0, projector_learning_rate=1e-2, init=str(first), init_scale=0.5)
    start = jax.device_get(decoder.initial_trainable(tiny, config))
    whole = jax.device_get(decoder.initial_trainable(tiny, dataclasses.replace(config, init_scale=1.0)))
    chex.assert_trees_all_close(jax.tree.map(lambda ad: ad["b"], start["adapters"], is_leaf=lambda x: "b" in x),
                                jax.tree.map(lambda ad: 0.5 * ad["b"], whole["adapters"], is_leaf=lambda x: "b" in x))
    assert any(float(np.abs(ad["b"]).max()) > 0 for layer in start["adapters"] for ad in layer.values())
    after = _train(tiny, config, tmp_path / "projector")
    chex.assert_trees_all_equal(after["adapters"], start["adapters"])
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, after["projector"], start["projector"])))
    with pytest.raises(ValueError, match="both 0: nothing would train"):
        dataclasses.replace(config, projector_learning_rate=0.0)
    with pytest.raises(ValueError, match="init_scale must be a finite number > 0, and 1 without an init"):
        dataclasses.replace(config, init=None)


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


def _mostly(picture: np.ndarray, colour: tuple[int, int, int], patch: int) -> np.ndarray:
    """[P] bool, row-major: a tenth or more of the patch's pixels are within 40 of `colour` (RGB): a patch
    an object covers a quarter of qualifies, its blended edge pixels aside."""
    near = np.abs(picture.astype(int) - np.asarray(colour)).max(-1) <= 40  # [S, S]
    grid = picture.shape[0] // patch
    return near.reshape(grid, patch, grid, patch).mean((1, 3)).reshape(-1) >= 0.1


def test_answer_reads_name_the_patches_of_what_each_answer_is_about():
    """Read off the rendered pictures: a single-picture answer reads patches of the named object's colour
    (a count: of every object's), a multi-picture answer the object's patches of the picture it names or
    reveals, a count of pictures the counted pictures (a tallied one nothing), a text fact nothing."""
    from lookm_jax import scenes
    from lookm_jax.train.data import answer_reads

    size, patch, tokens = 112, 14, 64
    checked = set()
    for i in range(40):
        sample = scenes.single_picture_sample("train", 0, i, turns=3)
        picture = np.asarray(scenes.render(sample.scene, size))
        for q, read in zip(sample.questions, answer_reads(sample.questions, (sample.scene,), size, tokens)):
            named = sample.scene.objects if q.kind == "count" else (sample.scene.objects[q.subject],)
            coloured = np.logical_or.reduce([_mostly(picture, scenes.COLOURS[o.colour], patch) for o in named])
            assert read.size and set(read) <= set(np.flatnonzero(coloured)), (i, q)
            checked.add(q.kind)
    for i in range(40):
        sample = scenes.multi_picture_sample("train", 0, i, 6, turns=4, kinds=scenes.PICTURE_KINDS, text_fact=True)
        reads = answer_reads(sample.questions, sample.scenes, size, tokens)
        for q, read in zip(sample.questions, reads):
            pictures = {q.subject} if q.subject is not None else set(q.counted)
            assert set(read // tokens) == pictures, (i, q)
            for k in pictures:
                o = sample.scenes[k].objects[0]
                mine = read[read // tokens == k] % tokens
                assert mine.size and set(mine) <= set(np.flatnonzero(
                    _mostly(np.asarray(scenes.render(sample.scenes[k], size)), scenes.COLOURS[o.colour], patch)))
            checked.add(q.kind)
        tallied = answer_reads(sample.questions, sample.scenes, size, tokens, "tallied")
        for q, read, word in zip(sample.questions, tallied, reads):  # a tallied count's first token reads nothing
            assert read.size == 0 if q.kind == "count_pictures" else np.array_equal(read, word), (i, q)
    assert checked == set(scenes.KINDS) | set(scenes.PICTURE_KINDS) | {"text_fact"}
    with pytest.raises(ValueError, match="not a patch grid"):
        answer_reads(sample.questions, sample.scenes, size, 60)


def test_a_batch_marks_each_answer_s_reads_among_its_image_placeholders():
    from lookm_jax import loading, scenes
    from lookm_jax.train.data import Encoder, answer_reads, single_picture_conversation

    demo = loading.demo_model(decoder="frozen")
    encoder = Encoder.of(demo)
    for spec in decoder.DEFAULT_BATCHES[:2]:
        batch = spec.make(encoder, "train", 0, 0, 112)
        chex.assert_shape(batch.read_mask, (spec.batch_size, spec.max_targets, spec.length))
        is_image = batch.ids == demo.config.image_token_id
        assert not (batch.read_mask & ~is_image[:, None, :]).any()  # only image placeholders
        assert not batch.read_mask[~batch.answer_start].any()  # only at an answer's first token
        assert batch.read_mask.any(-1).sum() >= batch.answer_start.sum() // 2
    sample = scenes.single_picture_sample("train", 0, 3, turns=2)
    reads = answer_reads(sample.questions, (sample.scene,), 112, 64)
    picture = [scenes.render(sample.scene, 112)]
    with pytest.raises(ValueError, match="has 2 answers and 1 reads"):
        encoder.batch([single_picture_conversation(sample)], picture, 160, 8, [reads[:1]])


def _read_batch(model) -> dict:
    """Two rows of text, a 25-token image, text; answers after the image, two of them reading a few of
    its tokens and one reading none."""
    rng = np.random.default_rng(2)
    n_image, length = model.config.image_seq_length, 40
    ids = np.concatenate([rng.integers(0, 200, (2, 4)), np.full((2, n_image), IMAGE_TOKEN),
                          rng.integers(0, 200, (2, length - 4 - n_image))], axis=1).astype(np.int32)
    positions = np.tile(np.array([31, 34, 38], np.int32), (2, 1))
    read = np.zeros((2, 3, length), bool)
    read[0, 0, [5, 9, 20]] = read[0, 2, [28]] = read[1, 1, 6:12] = True
    first = np.ones((2, 3), bool)
    return {"ids": ids, "valid": np.ones((2, length), bool), "target_positions": positions,
            "targets": rng.integers(0, 200, (2, 3)).astype(np.int32), "target_mask": first, "answer_start": first,
            "read_mask": read, "pixel_values": rng.standard_normal((2, *model.config.pixel_shape)).astype(np.float32)}


def test_read_shares_are_the_attention_transformers_computes(tmp_path):
    """Per layer, the heads' summed attention from each answer position on its read tokens over that on
    every image token, against HF's eager attention probabilities (float64 sums)."""
    import torch

    import lookm_jax

    hf = tiny_llava(tmp_path, heads=4, kv_heads=2, layers=3)
    model = lookm_jax.load(str(tmp_path))
    batch = _read_batch(model)
    x, is_image = llava.embed(model.config, model.params, jnp.asarray(batch["ids"]), jnp.asarray(batch["pixel_values"]))
    _, log_shares = jax.jit(lambda x: decoder.read_shares(model.config.text, model.params["text"], x, is_image,
                                                          jax.tree.map(jnp.asarray, batch)))(x)
    chex.assert_shape(log_shares, (3, 2, 3))
    reading = batch["read_mask"].any(-1)  # 3 of the 6 answers read something; the others' log share is 0
    assert (np.asarray(log_shares)[:, ~reading] == 0).all()
    shares = np.exp(np.asarray(log_shares))
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(batch["ids"], dtype=torch.long),
                 pixel_values=torch.as_tensor(batch["pixel_values"]), output_attentions=True)
    image = batch["ids"] == IMAGE_TOKEN
    for n, attention in enumerate(out.attentions):
        summed = attention.double().numpy().sum(1)  # [B, L, L], over heads
        for b in range(2):
            at = summed[b, batch["target_positions"][b]]  # [A, L]
            expected = (at * batch["read_mask"][b]).sum(-1) / (at * image[b]).sum(-1)
            np.testing.assert_allclose(shares[n, b, reading[b]], expected[reading[b]], rtol=2e-5)
    loss, share = decoder.read_loss(log_shares, jnp.asarray(batch["read_mask"]), (0, 2))
    np.testing.assert_allclose(float(share), shares[[0, 2]][:, reading].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(loss), -np.log(shares[[0, 2]][:, reading]).mean(), rtol=1e-5)
    # No NaN where a target's position sees no image token at all (a text answer before any picture).
    early = {**batch, "target_positions": np.tile(np.array([1, 34, 38], np.int32), (2, 1))}
    grad = jax.grad(lambda x: decoder.read_loss(decoder.read_shares(model.config.text, model.params["text"], x,
                                                                    is_image, jax.tree.map(jnp.asarray, early))[1],
                                                jnp.asarray(early["read_mask"]), (0, 1, 2))[0])(x)
    assert bool(jnp.isfinite(grad).all())


def test_the_read_loss_moves_attention_onto_the_read_tokens(tiny, tmp_path):
    batch, bank = data_batch_with_reads(tiny), _bank(tiny)
    config = _config(30, read_weight=1.0, read_layers=(0, 1))
    decoder.train(tiny, config, str(tmp_path), batch_fn=lambda step: batch, replay_bank=bank, progress=False)
    records = [json.loads(line) for line in open(tmp_path / decoder.LOG)]
    first, last = records[0], records[-1]
    assert last["read_share"] > 2 * first["read_share"] and last["read_loss"] < first["read_loss"], (first, last)
    with pytest.raises(ValueError, match="read_weight > 0 needs read_layers"):
        _config(3, read_weight=1.0)
    with pytest.raises(ValueError, match=r"read_layers must be < the decoder's 2 layers, got \(0, 2\)"):
        decoder.train(tiny, _config(3, read_weight=1.0, read_layers=(0, 2)), str(tmp_path / "x"),
                      batch_fn=lambda step: batch, replay_bank=bank, progress=False)


def data_batch_with_reads(model) -> "decoder.Batch":
    """`_read_batch` as a `data.Batch`."""
    from lookm_jax.train.data import Batch

    b = _read_batch(model)
    return Batch(b["ids"], b["valid"], b["pixel_values"], b["target_positions"], b["targets"], b["target_mask"],
                 b["answer_start"], b["read_mask"])


def test_decoder_command_read_flags_reach_the_config_and_bad_ones_are_refused(tmp_path, capsys):
    from lookm_jax import cli
    from lookm_jax.train.decoder_command import decoder_config

    def config(*flags):
        return decoder_config(cli.build_parser().parse_args(["train", "decoder", "--output", "run", *flags]))

    assert config().read_weight == 0 and config().read_layers == ()
    assert config("--read-weight", "0.2", "--read-layers", "19-22").read_layers == (19, 20, 21, 22)
    assert config("--read-weight", "0.2", "--read-layers", "3,5").read_layers == (3, 5)
    assert config().subspace_dims == 0 and config("--subspace-dims", "64").subspace_dims == 64
    assert config().replay_generated == 0 and config("--replay-generated", "1500").replay_generated == 1500
    assert config().batches == decoder.DEFAULT_BATCHES
    frozen_adapters = config("--learning-rate", "0", "--init", "shipped", "--init-scale", "0.5")
    assert (frozen_adapters.learning_rate, frozen_adapters.init_scale) == (0.0, 0.5)
    with pytest.raises(ValueError, match="--learning-rate and --projector-learning-rate are both 0: nothing would train"):
        config("--learning-rate", "0", "--projector-learning-rate", "0")
    assert config("--count-answers", "listed").batches == decoder.with_count_form("listed")
    assert config("--count-answers", "tallied").batches == decoder.with_count_form("tallied")
    out = tmp_path / "run"
    for flag, value, message in (("--read-weight", "0.2", "--read-weight > 0 needs --read-layers (e.g. 19-26)"),
                                 ("--read-weight", "-1", "--read-weight must be >= 0, got -1.0"),
                                 ("--read-layers", "5-3", "argument --read-layers: expected FIRST-LAST or"),
                                 ("--read-layers", "2,2", "argument --read-layers: expected FIRST-LAST or"),
                                 ("--subspace-dims", "-1", "argument --subspace-dims:"),
                                 ("--replay-generated", "-1", "argument --replay-generated:"),
                                 ("--learning-rate", "-1", "--learning-rate must be >= 0, got -1.0"),
                                 ("--init-scale", "0.5", "--init-scale scales the --init adapters, and no --init was given")):
        with pytest.raises(SystemExit) if message.startswith("argument") else contextlib.nullcontext():
            assert cli.main(["train", "decoder", "--output", str(out), flag, value]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()

"""The vision trainer (lookm_jax.train): loss falls on a fixed batch, kill + resume = uninterrupted,
stage-0 patch labels, and training batches that match what the model sees at inference."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from lookm_jax import plots, scenes
from lookm_jax.train import data, tower, vision
from tests.conftest import IMAGE_TOKEN, tiny_llava

LENGTH, TARGETS = 40, 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random LLaVA with its LM head tied to the (unit-variance) embedding, so logits can be
    peaked: with HF's 0.02-std head no input could halve the loss."""
    import lookm_jax

    folder = tmp_path_factory.mktemp("tiny_tied")
    tiny_llava(folder, tie=True)
    return lookm_jax.load(str(folder))


def _fixed_batch(model) -> data.Batch:
    """Two rows: text, one 25-token image, more text. The targets are read at the last image
    positions: a tiny random decoder passes little from image to text tokens through attention, but
    an image token's own logits follow its feature, so the trainable side can fit them."""
    rng = np.random.default_rng(0)
    n_image = model.config.image_seq_length
    ids = np.concatenate([rng.integers(0, 200, (2, 4)), np.full((2, n_image), IMAGE_TOKEN),
                          rng.integers(0, 200, (2, LENGTH - 4 - n_image))], axis=1).astype(np.int32)
    valid = np.ones((2, LENGTH), bool)
    positions = np.tile(np.arange(4 + n_image - TARGETS, 4 + n_image, dtype=np.int32), (2, 1))
    targets = rng.integers(0, 200, (2, TARGETS)).astype(np.int32)
    pixels = rng.standard_normal((2, *model.config.pixel_shape)).astype(np.float32)
    mask = np.ones((2, TARGETS), bool)
    return data.Batch(ids, valid, pixels, positions, targets, mask, mask)


def _config(steps: int) -> vision.TrainConfig:
    return vision.TrainConfig(steps=steps, learning_rate=1e-2, warmup_steps=2, checkpoint_every=3,
                              pretrain=None, multi=None)


def test_loss_halves_on_a_fixed_batch(tiny, tmp_path):
    batch = _fixed_batch(tiny)
    vision.train(tiny, _config(30), str(tmp_path), batch_fn=lambda step: batch, progress=False)
    losses = [json.loads(line)["loss"] for line in open(tmp_path / vision.LOG)]
    assert len(losses) == 30
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_tower_moves_only_at_a_positive_learning_rate_scale(tiny, tmp_path, scale):
    batch = _fixed_batch(tiny)
    config = dataclasses.replace(_config(3), tower_learning_rate_scale=scale)
    trained = vision.train(tiny, config, str(tmp_path), batch_fn=lambda step: batch, progress=False)
    before = jax.device_get({k: tiny.params[k] for k in vision.TRAINABLE})
    moved = {k: not jax.tree.all(jax.tree.map(np.array_equal, trained[k], before[k])) for k in before}
    assert moved == {"vision": scale > 0, "projector": True}


def test_killed_run_resumes_to_the_uninterrupted_parameters(tiny, tmp_path):
    batches = {s: dataclasses.replace(_fixed_batch(tiny), targets=_fixed_batch(tiny).targets + s)
               for s in range(1, 8)}  # a different batch per step, as the scene stream gives

    def run(folder, stop_after=None):
        return vision.train(tiny, _config(7), str(folder), batch_fn=batches.__getitem__,
                            stop_after=stop_after, progress=False)

    whole = run(tmp_path / "whole")
    first = run(tmp_path / "killed", stop_after=4)  # checkpoints at 3 and at 4, then "dies"
    with open(tmp_path / "killed" / vision.LOG, "a") as log:
        log.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')  # steps logged after the checkpoint
    resumed = run(tmp_path / "killed")
    assert not jax.tree.all(jax.tree.map(np.array_equal, first, whole))
    chex.assert_trees_all_equal(resumed, whole)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "killed" / vision.LOG)]
    assert steps == list(range(1, 8))
    with pytest.raises(ValueError, match=r"written with other settings \(learning_rate: 0.01 -> 0.02\)"):
        vision.train(tiny, dataclasses.replace(_config(7), learning_rate=0.02), str(tmp_path / "killed"),
                     batch_fn=batches.__getitem__, progress=False)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / vision.CHECKPOINT).write_bytes(b"\x93\x01\x02\x03 not msgpack")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        run(tmp_path / "garbage")


def test_diverged_run_stops_before_writing_nan(tiny, tmp_path):
    batch = _fixed_batch(tiny)
    poisoned = dataclasses.replace(batch, pixel_values=np.full_like(batch.pixel_values, np.nan))
    with pytest.raises(ValueError, match=r"stage-1 loss became nan at step 4 \(learning rate 0.01: too high\?\)"):
        vision.train(tiny, _config(6), str(tmp_path), batch_fn=lambda step: poisoned if step == 4 else batch,
                     progress=False)
    assert [json.loads(line)["step"] for line in open(tmp_path / vision.LOG)] == [1, 2, 3]
    resumed = vision.train(tiny, _config(6), str(tmp_path), batch_fn=lambda step: batch, progress=False)  # from 3
    assert jax.tree.all(jax.tree.map(lambda a: bool(np.isfinite(a).all()), resumed))
    assert [json.loads(line)["step"] for line in open(tmp_path / vision.LOG)] == list(range(1, 7))


def test_anchored_run_fits_its_head_lowers_the_patch_loss_and_resumes(tiny, tmp_path):
    """With an anchor, the head is fitted on the starting tower (no stage 0 in this run), every step
    logs stage 0's patch loss, which falls as the tower trains, a killed run resumes to the same
    parameters (anchor batches included), and the exported weights leave the head out."""
    from lookm_jax import loading

    batch = _fixed_batch(tiny)
    config = dataclasses.replace(_config(12), tower_learning_rate_scale=1.0, anchor_weight=1.0,
                                 anchor_batch_size=8, anchor_scenes=32)

    def run(folder, stop_after=None):
        return vision.train(tiny, config, str(folder), batch_fn=lambda step: batch, stop_after=stop_after,
                            progress=False)

    whole = run(tmp_path / "whole")
    records = [json.loads(line) for line in open(tmp_path / "whole" / vision.LOG)]
    fit, steps = records[0]["anchor_head_fit"], records[1:]
    assert set(fit) == set(tower.TARGETS) and fit["colour"] > 0.5, fit
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert plots.read_training_log(str(tmp_path / "whole" / vision.LOG)) == steps  # `lookm plot training` reads it
    assert np.mean([r["anchor_loss"] for r in steps[-3:]]) < np.mean([r["anchor_loss"] for r in steps[:3]])
    assert set(whole) == {"vision", "projector", "head"}
    run(tmp_path / "killed", stop_after=5)
    chex.assert_trees_all_equal(run(tmp_path / "killed"), whole)
    path = str(tmp_path / "vision.safetensors")
    vision.export_weights(path, whole, {})
    chex.assert_trees_all_equal(loading.read_demo_vision(path), {k: whole[k] for k in vision.TRAINABLE})


def test_trained_weights_are_exported_and_read_back(tiny, tmp_path):
    from lookm_jax import loading

    trainable = {k: tiny.params[k] for k in vision.TRAINABLE}
    path = str(tmp_path / "vision.safetensors")
    vision.export_weights(path, trainable, {"note": "test"})
    chex.assert_trees_all_equal(loading.read_demo_vision(path), jax.device_get(trainable))
    with pytest.raises(FileNotFoundError, match="trained vision weights are missing"):
        loading.read_demo_vision(str(tmp_path / "absent.safetensors"))


def test_train_config_refuses_bad_values():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        vision.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="warmup_steps < steps"):
        vision.TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match=r"tower_learning_rate_scale must be in \[0, 1\]"):
        vision.TrainConfig(tower_learning_rate_scale=2.0)
    with pytest.raises(ValueError, match=r"anchor_weight must be >= 0, and > 0 only while the tower trains"):
        vision.TrainConfig(anchor_weight=1.0)  # the tower frozen: nothing to anchor
    for name in ("learning_rate", "anchor_weight"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number, got inf"):
            vision.TrainConfig(tower_learning_rate_scale=0.1, **{name: float("inf")})
    with pytest.raises(ValueError, match="anchor_batch_size <= anchor_scenes"):
        vision.TrainConfig(tower_learning_rate_scale=0.1, anchor_weight=1.0, anchor_scenes=8)


def test_patch_labels_follow_the_drawn_objects():
    scene = scenes.Scene((scenes.SceneObject("blue", "square", 0.25, 0.25, 0.2),), (200, 200, 200), (0.0, 0.0), 0)
    labels = tower.patch_labels(scene, 112, 14)
    assert set(labels) == set(tower.TARGETS)
    grid = {name: v.reshape(8, 8) for name, v in labels.items()}
    assert grid["colour"][2, 2] == 1 + list(scenes.COLOURS).index("blue")
    assert grid["shape"][2, 2] == scenes.SHAPES.index("square")
    assert (grid["side"][2, 2], grid["half"][2, 2]) == (0, 0)  # left, top
    assert grid["colour"][6, 6] == 0  # background
    assert 0 < (grid["colour"] > 0).sum() < 64
    assert (labels["count"] == 0).all()  # one object


def test_pretraining_raises_patch_accuracy(tiny):
    cfg = tiny.config.vision  # 30 px, 6 px patches
    config = tower.PretrainConfig(steps=80, batch_size=16, dataset=64, learning_rate=3e-3, warmup_steps=4)
    _, _, log = tower.pretrain(cfg, tiny.params["vision"], lambda p: tiny.preprocess_images(p)[0], config, progress=False)
    assert set(log[0]) == {"pretrain_step", "loss"} | {f"{name}_accuracy" for name in tower.TARGETS}
    first, last = ({k: np.mean([r[k] for r in part]) for k in log[0]} for part in (log[:10], log[-10:]))
    assert last["loss"] < first["loss"] - 1.0
    assert last["colour_accuracy"] > 0.9 > first["colour_accuracy"]
    assert last["shape_accuracy"] > first["shape_accuracy"] + 0.1  # the loss runs over object patches only


def test_training_conversation_matches_inference_prompt(demo):
    encoder = data.Encoder.of(demo)
    sample = scenes.single_picture_sample("train", 0, 3, turns=3)
    ids, role = encoder.conversation(data.single_picture_conversation(sample))
    first_answer = role.index(1)
    np.testing.assert_array_equal(ids[:first_answer], demo.encode_chat(sample.questions[0].text, num_images=1)[0])
    answers = demo.tokenizer.decode([t for t, r in zip(ids, role) if r], skip_special_tokens=False)
    assert answers == "".join(scenes.answer_text(q.answer) + "<|im_end|>" for q in sample.questions)
    assert sum(r == 1 for r in role) == len(sample.questions) > 1
    assert ids.count(demo.config.image_token_id) == demo.config.image_seq_length


@pytest.mark.parametrize("turns", range(1, data.MAX_SINGLE_TURNS + 1))
def test_single_picture_spec_fits_its_conversations(demo, turns):
    encoder = data.Encoder.of(demo)
    spec = data.single_picture_spec(batch_size=4, turns=turns)
    lengths, answers = [], []
    for split, i in [(split, i) for split in ("train", "heldout", "combination") for i in range(100)]:
        ids, role = encoder.conversation(data.single_picture_conversation(
            scenes.single_picture_sample(split, 0, i, turns)))
        lengths.append(len(ids))
        answers.append(sum(r > 0 for r in role))
    assert max(lengths) <= spec.length and max(answers) <= spec.max_targets
    assert max(lengths) > spec.length - 32  # the static length is not padding for its own sake
    batch = spec.make(encoder, "train", 0, 0, demo.config.pixel_shape[-1])
    assert batch.answer_start.sum() == sum(len(s.questions) for s in scenes.single_picture_samples("train", 0, 4, turns))


def test_single_picture_spec_refuses_turns_out_of_range():
    for turns in (0, data.MAX_SINGLE_TURNS + 1):
        with pytest.raises(ValueError, match=re.escape(f"turns must be in [1, {data.MAX_SINGLE_TURNS}], got {turns}")):
            data.single_picture_spec(8, turns)


def test_multi_picture_batch_shapes(demo):
    encoder = data.Encoder.of(demo)
    spec = vision.TrainConfig().multi
    batch = spec.make(encoder, "train", 0, 0, demo.config.pixel_shape[-1])
    chex.assert_shape(batch.pixel_values, (spec.batch_size * spec.pictures, *demo.config.pixel_shape))
    chex.assert_shape([batch.ids, batch.valid], (spec.batch_size, spec.length))
    chex.assert_shape([batch.targets, batch.target_mask, batch.answer_start], (spec.batch_size, spec.max_targets))
    counts = [spec.picture_count("train", 0, i) for i in range(spec.batch_size)]
    np.testing.assert_array_equal((batch.ids == demo.config.image_token_id).sum(1),
                                  np.asarray(counts) * demo.config.image_seq_length)
    # The picture counts vary over [min_pictures, pictures]; the pictures padding the end are blank.
    drawn = {spec.picture_count("train", 0, i) for i in range(64)}
    assert min(drawn) == spec.min_pictures >= 2 and max(drawn) == spec.pictures
    padding = batch.pixel_values[sum(counts):]
    assert len(padding) == spec.batch_size * spec.pictures - sum(counts) > 0
    assert (padding == padding[..., :1, :1]).all()  # one value per channel: black, normalised
    with pytest.raises(ValueError, match="min_pictures must be in"):
        dataclasses.replace(spec, min_pictures=9)
    # With text facts every conversation still fits, and one answer in each is the fact's number.
    facts = dataclasses.replace(spec, text_facts=True).make(encoder, "train", 0, 0, demo.config.pixel_shape[-1])
    chex.assert_equal_shape([facts.ids, batch.ids])
    for row in range(spec.batch_size):
        fact_q = next(q for q in scenes.multi_picture_sample("train", 0, row, counts[row], spec.turns, text_fact=True)
                      .questions if q.kind == "text_fact")
        answers = demo.tokenizer.decode(facts.targets[row][facts.target_mask[row]].tolist(), skip_special_tokens=False)
        assert fact_q.answer + "." in answers
    with pytest.raises(ValueError, match="does not fit the batch length"):
        dataclasses.replace(spec, length=100).make(encoder, "train", 0, 0, demo.config.pixel_shape[-1])


def test_every_multi_picture_conversation_fits_its_static_batch(demo):
    """The longest case, 8 pictures with a text fact, over 300 samples: within `length` and
    `max_targets` (a sample that did not fit would stop a run hours in)."""
    encoder, spec = data.Encoder.of(demo), vision.TrainConfig().multi
    for i in range(300):
        for text_fact in (False, True):
            sample = scenes.multi_picture_sample("train", 0, i, spec.pictures, spec.turns, text_fact=text_fact)
            ids, role = encoder.conversation(data.multi_picture_conversation(sample))
            assert len(ids) <= spec.length and sum(1 for t, r in enumerate(role) if r and t > 0) <= spec.max_targets


def test_tower_probe_bench_reads_every_target(tmp_path):
    """bench/probe_tower.py on the seeded tower, a few scenes: one probe per stage-0 target."""
    out = tmp_path / "probe.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "bench/probe_tower.py", "--init", "--train", "16", "--heldout", "8",
                           "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    targets = json.loads(out.read_text())["targets"]
    assert set(targets) == set(tower.TARGETS)
    # Colour is linearly readable even from the seeded tower: above always guessing background.
    assert targets["colour"]["accuracy"] > targets["colour"]["majority"] + 0.05
    assert all(0 < r["patches"] and 0 <= r["accuracy"] <= 1 for r in targets.values())


def test_train_command_refuses_bad_arguments_before_writing(tmp_path, capsys):
    from lookm_jax import cli

    out = tmp_path / "run"
    for flag, value, message in (("--tower-lr-scale", "2", "--tower-lr-scale must be in [0, 1], got 2.0"),
                                 ("--pretrain-steps", "-1", "argument --pretrain-steps: must be an integer >= 0, got -1"),
                                 ("--eval-every", "0", "argument --eval-every: must be an integer >= 1, got 0"),
                                 ("--learning-rate", "0", "argument --learning-rate: must be a finite number > 0, got 0"),
                                 ("--warmup-steps", "500", "--warmup-steps must be < --steps, got 500 and 400"),
                                 ("--pretrain-scenes", "8", "--pretrain-scenes must be >= 32 (one stage-0 batch), got 8"),
                                 ("--anchor-weight", "1", "--anchor-weight must be >= 0, and > 0 only with "
                                                          "--tower-lr-scale > 0, got 1.0 with --tower-lr-scale 0.0"),
                                 ("--stop-after", "-1", "argument --stop-after: must be an integer >= 0, got -1"),
                                 ("--turns", "4", "--turns must be in [1, 3], got 4"),
                                 ("--stop-after", "0", "--stop-after 0 exports the run's checkpoint, and"),
                                 ("--learning-rate", "inf", "argument --learning-rate: must be a finite number > 0, got inf"),
                                 ("--anchor-weight", "nan", "argument --anchor-weight: must be a finite number, got nan"),
                                 ("--seed", "-1", "argument --seed: must be an integer in [0, 4294967295], got -1"),
                                 ("--output", "", "argument --output: must be a path, got an empty string")):
        with pytest.raises(SystemExit) if message.startswith("argument") else contextlib.nullcontext():  # argparse's
            assert cli.main(["train", "vision", "--output", str(out), flag, value]) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli.main(["train", "vision", "--output", str(tmp_path / "file")]) == 2
    assert "--output " + str(tmp_path / "file") + " is a file, not a folder" in capsys.readouterr().err
    assert cli.main(["train", "vision", "--output", str(out), "--init", str(tmp_path)]) == 2
    assert "is a folder; give the demo_vision.safetensors" in capsys.readouterr().err
    (tmp_path / "text.safetensors").write_text("not weights")
    save_file({"vision.patch": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    for name, message in (("text", "not a readable safetensors file"), ("other", "not the demo's vision weights")):
        assert cli.main(["train", "vision", "--output", str(out), "--init", str(tmp_path / f"{name}.safetensors")]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_train_command_flags_reach_the_config():
    from lookm_jax import cli
    from lookm_jax.train import command

    def config(*flags):
        return command.train_config(cli.build_parser().parse_args(["train", "vision", "--output", "run", *flags]))

    plain = config()
    assert not plain.multi.text_facts and plain.multi_every == 4
    assert plain.pretrain == tower.PretrainConfig()  # the command's stage-0 defaults are the library's
    facts = config("--text-facts", "--multi-every", "2", "--init", "w.safetensors", "--tower-lr-scale", "0.5")
    assert facts.multi.text_facts and facts.multi_every == 2 and facts.pretrain is None
    assert facts.tower_learning_rate_scale == 0.5 and facts.multi.min_pictures == plain.multi.min_pictures
    assert plain.anchor_weight == 0 and config("--tower-lr-scale", "0.2", "--anchor-weight", "0.5").anchor_weight == 0.5
    assert config("--multi-every", "0").multi is None
    assert plain.single == vision.TrainConfig().single  # the library's default is the command's
    assert command.MAX_TURNS == data.MAX_SINGLE_TURNS
    one = config("--turns", "1", "--batch-size", "16").single
    assert (one.turns, one.batch_size, one.pictures) == (1, 16, 1) and one.length < plain.single.length
    assert vision.TrainConfig().multi_every == plain.multi_every  # the library's default is the command's
    with pytest.raises(ValueError, match="--text-facts needs multi-picture steps"):
        config("--text-facts", "--multi-every", "0")


def test_pretrain_config_refuses_fewer_scenes_than_a_batch():
    with pytest.raises(ValueError, match="dataset must be >= batch_size=32, got 8"):
        tower.PretrainConfig(dataset=8)

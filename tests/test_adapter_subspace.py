"""Adapters restricted to the input directions pictures use (lookm_jax.train.subspace): the second moments
are the inputs transformers' projections see, the directions are the ones only the wanted inputs use,
and a restricted stage-2 run reads only its subspace, resumes exactly and moves text less."""

from __future__ import annotations

import dataclasses
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from lookm_jax.models import llama
from lookm_jax.train import decoder, subspace
from tests.conftest import tiny_llava
from tests.test_train import tiny  # noqa: F401  (the tiny tied LLaVA fixture)
from tests.test_train_decoder import _bank, _config, _train

# transformers' module whose input is each adapted weight's input
HF_MODULES = {"w_qkv": "self_attn.q_proj", "wo": "self_attn.o_proj", "w_gate_up": "mlp.gate_proj",
              "w_down": "mlp.down_proj"}


def test_input_moments_are_the_inputs_transformers_projections_see(tmp_path):
    import torch

    import lookm_jax

    hf = tiny_llava(tmp_path, layers=3)
    model = lookm_jax.load(str(tmp_path))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 200, (2, 11)).astype(np.int32)
    valid = np.ones((2, 11), bool)
    valid[1, 7:] = False  # a right-padded row: its padding is not counted
    current, expected = {}, {}
    hooks = [module.register_forward_hook(
        lambda m, inputs, out, key=(i, name): current.__setitem__(key, inputs[0][0].double().numpy()))
        for i, layer in enumerate(hf.model.language_model.layers) for name, path in HF_MODULES.items()
        for module in [layer.get_submodule(path)]]
    with torch.no_grad():
        for row in range(2):  # one row at a time, its padding left out
            hf.model.language_model(input_ids=torch.tensor(ids[row:row + 1, valid[row]].astype(np.int64)))
            for key, x in current.items():  # x [L, In]
                expected[key] = expected.get(key, 0.0) + x.T @ x
    for hook in hooks:
        hook.remove()
    text = model.params["text"]
    moments = subspace.input_moments(model.config.text, text, llama.embed_tokens(text, jnp.asarray(ids)),
                                     jnp.asarray(valid))
    for i in range(3):
        for name in llama.ADAPTED_WEIGHTS:
            want = expected[(i, name)]
            chex.assert_shape(moments[name], (3, *want.shape))
            np.testing.assert_allclose(np.asarray(moments[name][i]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                       err_msg=f"layer {i} {name}")


def test_top_directions_are_the_ones_only_the_wanted_inputs_use():
    rng = np.random.default_rng(0)
    mixing = np.linalg.qr(rng.standard_normal((6, 6)))[0]  # a random orthonormal frame
    text = mixing @ np.diag([3.0, 2.0, 1.0, 1.0, 0.0, 0.0]) @ mixing.T  # text uses none of columns 4, 5
    pictures = mixing @ np.diag([3.0, 2.0, 1.0, 0.1, 0.5, 0.2]) @ mixing.T  # pictures use 4 most, then 5
    basis = subspace.top_directions(pictures, text, 1)
    chex.assert_shape(basis, (6, 1))
    assert abs(float(basis[:, 0] @ mixing[:, 4])) > 0.999
    two = subspace.top_directions(pictures, text, 2)
    np.testing.assert_allclose(two.T @ two, np.eye(2), atol=1e-5)  # orthonormal
    np.testing.assert_allclose(two @ two.T, mixing[:, 4:] @ mixing[:, 4:].T, atol=1e-3)  # the span text never uses
    three = subspace.top_directions(pictures, text, 3)  # then the text direction pictures use most for its share
    assert abs(float(mixing[:, 0] @ three @ three.T @ mixing[:, 0])) > 0.99
    with pytest.raises(ValueError, match=r"subspace dims must be in 1\.\.6"):
        subspace.top_directions(pictures, text, 7)


def _text_change(model, adapters, scale: float, bank) -> float:
    """Mean |adapted - frozen| of the logits over the bank's text-only prompts and continuations (the tiny
    decoder's distributions are too peaked for a KL to show the change)."""
    batch = decoder.replay_batch(bank, range(len(bank.prompts)), length=24)
    frozen = model.params["text"]
    x, valid = llama.embed_tokens(frozen, jnp.asarray(batch["ids"])), jnp.asarray(batch["valid"])

    def logits(text):
        return llama.lm_logits(text, llama.forward(model.config.text, text, x, valid))

    adapted = decoder.adapted_text({"text": frozen}, jax.tree.map(jnp.asarray, adapters), scale)
    return float(jnp.abs(logits(adapted) - logits(frozen))[valid].mean())


def test_a_restricted_run_reads_only_its_subspace_resumes_exactly_and_moves_text_less(tiny, tmp_path):
    config = _config(6, subspace_dims=4, replay_weight=0.0, projector_learning_rate=1e-3)
    whole = _train(tiny, config, tmp_path / "whole")
    bases = subspace.unflatten(load_file(str(tmp_path / "whole" / decoder.SUBSPACE_FILE)), 2)
    for layer, basis in zip(whole["adapters"], bases):
        for name, ad in layer.items():
            chex.assert_shape(basis[name], (ad["a"].shape[1], 4))
            np.testing.assert_allclose(ad["a"] @ basis[name] @ basis[name].T, ad["a"], atol=1e-5)  # in its span
    _train(tiny, config, tmp_path / "killed", stop_after=4)
    os.remove(tmp_path / "killed" / decoder.SUBSPACE_FILE)  # made again, the same, from the run's start
    chex.assert_trees_all_equal(_train(tiny, config, tmp_path / "killed"), whole)
    chex.assert_trees_all_equal(*(load_file(str(tmp_path / run / decoder.SUBSPACE_FILE)) for run in ("whole", "killed")))
    free = _train(tiny, dataclasses.replace(config, subspace_dims=0), tmp_path / "free")
    bank = _bank(tiny, seed=7, prompt=15)  # text the subspace was not chosen on
    restricted, unrestricted = (_text_change(tiny, run["adapters"], config.scale, bank) for run in (whole, free))
    assert restricted < 0.5 * unrestricted, (restricted, unrestricted)


def test_subspace_dims_are_checked_and_a_file_made_for_other_settings_is_made_again(tiny, tmp_path):
    with pytest.raises(ValueError, match="subspace_dims must be >= 0"):
        decoder.DecoderConfig(subspace_dims=-1)
    with pytest.raises(ValueError, match=r"subspace_dims must be in 0\.\.48 \(the narrowest adapted input\), got 49"):
        _train(tiny, _config(3, subspace_dims=49), tmp_path / "wide")
    assert not (tmp_path / "wide" / decoder.SUBSPACE_FILE).exists()
    stale = tmp_path / "stale"

    def restart(config):  # no checkpoint yet: settings free
        for name in os.listdir(stale):
            if name.startswith("checkpoint") or name == decoder.LOG:
                os.remove(stale / name)
        _train(tiny, config, stale, stop_after=1)
        with safe_open(str(stale / decoder.SUBSPACE_FILE), "np") as made:
            return made.metadata(), made.get_tensor("layers.0.wo").shape

    _train(tiny, _config(3, subspace_dims=3), stale, stop_after=1)
    assert restart(_config(3, subspace_dims=5))[1] == (48, 5)
    tallied = decoder.with_count_form("tallied")  # other batches (their answers) alone: made again
    metadata, shape = restart(_config(3, subspace_dims=5, batches=tallied))
    assert metadata["batches"] == repr(tallied) and shape == (48, 5)

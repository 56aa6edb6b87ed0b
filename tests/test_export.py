"""Every compiled program lowers for GPU and TPU: `jax.export` for platforms cuda and tpu (no device
needed), so no CPU-only operation reaches an accelerator user unseen. Prefill and decode for every
method variant, the shared prefill and its compression, on a tiny LLaVA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lookm_jax
from lookm_jax import generate as gen
from method_variants import VARIANTS, build, ids
from tests.conftest import IMAGE_TOKEN, image_ids

PLATFORMS = ("cuda", "tpu")
MAX_NEW = 4


@pytest.fixture(scope="module")
def inputs(tiny_llava_folder):
    model = lookm_jax.load(tiny_llava_folder)
    per_image = model.config.image_seq_length
    row = image_ids(per_image, [1, 5, "img", 6, 7, 8])
    ids = np.zeros((2, 64), np.int32)
    valid = np.zeros((2, 64), bool)
    ids[:, :len(row)], valid[0, :len(row)], valid[1, :len(row) - 2] = row, True, True
    pixels = np.random.default_rng(0).standard_normal((2, *model.config.pixel_shape)).astype(np.float32)
    assert (ids == IMAGE_TOKEN).sum() == 2 * per_image
    return model, (model.config, model.params, jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(pixels),
                   jax.random.key(0))


def _exported(fn, *args, **static):
    exported = jax.export.export(fn, platforms=PLATFORMS)(*args, **static)
    assert tuple(exported.platforms) == PLATFORMS
    return exported


@pytest.mark.parametrize("name,params", VARIANTS, ids=ids(VARIANTS))
def test_prefill_and_decode_export_for_gpu_and_tpu(inputs, name, params):
    model, args = inputs
    method = build(name, params, budget=0.5)
    sampling = gen.Sampling()
    _exported(gen.prefill, *args, method=method, max_new_tokens=MAX_NEW, sampling=sampling)
    first, cache, _ = jax.eval_shape(functools.partial(gen.prefill, args[0], method=method, max_new_tokens=MAX_NEW,
                                                       sampling=sampling), *args[1:])
    _exported(gen.decode, model.text_config, model.params["text"], first, cache, args[-1], max_new_tokens=MAX_NEW,
              sampling=sampling, eos_ids=model.text_config.eos_token_ids)


def test_prefill_scored_by_reconstruction_exports_for_gpu_and_tpu(inputs):
    """The prompt encoded twice over (`scores="reconstruction"`), in the prefill and the shared prefill."""
    _, args = inputs
    method = build("lookm_quota", {"scores": "reconstruction"}, budget=0.5)
    _exported(gen.prefill, *args, method=method, max_new_tokens=MAX_NEW, sampling=gen.Sampling())
    _exported(gen.prefill_states, *args, statistics=method.statistics, window=1, sampling=gen.Sampling())


def test_shared_prefill_and_its_compression_export_for_gpu_and_tpu(inputs):
    _, args = inputs
    method = build("snapkv", {}, budget=0.5)
    window = gen.query_window(method, args[2].shape[1])
    _exported(gen.prefill_states, *args, statistics=method.statistics, window=window, sampling=gen.Sampling())
    prefilled = jax.eval_shape(functools.partial(gen.prefill_states, args[0], statistics=method.statistics,
                                                 window=window, sampling=gen.Sampling()), *args[1:])
    _exported(gen.compress_prefilled, prefilled, method=method, max_new_tokens=MAX_NEW)

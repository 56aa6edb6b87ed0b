"""The embedded demo model (`load_default`) and the main job (`lookm generate`)."""

from __future__ import annotations

import numpy as np
import pytest

import lookm_jax
from lookm_jax import cli
from lookm_jax.convert import store


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lookm_cache")


@pytest.fixture(scope="module")
def cold_and_warm(cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOKM_CACHE", str(cache))
    cold = lookm_jax.load_default()  # converts from the GGUF and caches
    warm = lookm_jax.load_default()  # reads the converted cache
    mp.undo()
    return cold, warm


def test_cached_demo_equals_fresh_conversion(cold_and_warm, cache):
    cold, warm = cold_and_warm
    assert store.is_converted(str(cache / "smollm2-135m-llava-demo"))
    for key, value in store.flatten(cold.params).items():
        np.testing.assert_array_equal(store.flatten(warm.params)[key], value, err_msg=key)


def test_demo_is_llava_shaped_with_untrained_vision(cold_and_warm):
    _, model = cold_and_warm
    assert model.is_multimodal and model.manifest["vision_untrained"]
    assert model.config.image_token_id == model.tokenizer.token_to_id("<image>")
    ids = model.encode_chat("hi", num_images=2)
    assert (ids == model.config.image_token_id).sum() == 2 * model.config.image_seq_length


def test_demo_text_answer_is_coherent(cold_and_warm):
    _, model = cold_and_warm
    ids = model.encode_chat("What is the capital of France?")
    assert "Paris" in model.decode_text(model.generate(ids, max_new_tokens=16)[0])


def test_stale_demo_cache_is_rebuilt(cold_and_warm, cache, monkeypatch):
    monkeypatch.setenv("LOOKM_CACHE", str(cache))
    monkeypatch.setattr(lookm_jax.loading, "DEMO_BUILD", -1)
    assert lookm_jax.load_default().manifest["demo_build"].startswith("-1:")


def test_main_job_runs_offline(cold_and_warm, cache, monkeypatch, capsys):
    monkeypatch.setenv("LOOKM_CACHE", str(cache))
    assert cli.main(["generate", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "UNTRAINED" in out and "answer:" in out and "with 2 image(s)" in out
    assert "512 image" in out and "ms/token" in out and "KV cache:" in out


def test_cli_reports_a_clear_error(capsys):
    assert cli.main(["generate", "--model", "/nonexistent/folder"]) == 2
    assert "not a folder or .gguf file" in capsys.readouterr().err

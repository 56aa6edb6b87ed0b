"""The embedded demo model (`load_default`) and the main job (`lookm generate`)."""

from __future__ import annotations

import os
import re
import shutil
import threading

import numpy as np
import pytest
from PIL import Image

from lookm_jax import cli, cli_args, loading, scenes
from lookm_jax.convert import store
from lookm_jax.convert.gguf import smollm2_gguf_path
from lookm_jax.eval.scenes import first_word
from lookm_jax.models import llama



def _demo_folder() -> str:
    return os.path.join(loading.cache_dir(), f"{loading.DEMO_NAME}-{loading.demo_key(smollm2_gguf_path())}")


def test_cached_demo_equals_fresh_conversion(demo):
    assert store.is_converted(_demo_folder())
    _, fresh, _ = loading.build_demo()
    cached = store.flatten({**demo.params, "text": llama.stored_params(demo.text_config, demo.params["text"])})  # the stored layout
    for key, value in store.flatten(fresh).items():
        np.testing.assert_array_equal(cached[key], value, err_msg=key)


def test_demo_is_llava_shaped_with_trained_vision(demo):
    assert demo.is_multimodal and demo.manifest["vision"] == loading.DEMO_VISION_NOTE
    assert demo.config.image_seq_length == 64
    assert demo.config.image_token_id == demo.tokenizer.token_to_id("<image>")
    ids = demo.encode_chat("hi", num_images=2)
    assert (ids == demo.config.image_token_id).sum() == 2 * demo.config.image_seq_length


def test_bundled_pictures_are_the_demo_scenes_rendered():
    """The demo's PNGs are `scenes.DEMO_SCENES` drawn by `scenes.render`: what the pictures show is known."""
    assert len(cli_args.DEFAULT_IMAGES) == len(scenes.DEMO_SCENES)
    for path, scene in zip(cli_args.DEFAULT_IMAGES, scenes.DEMO_SCENES):
        picture = Image.open(path).convert("RGB")
        np.testing.assert_array_equal(np.asarray(picture), np.asarray(scenes.render(scene, picture.width)), path)


def test_demo_text_answer_is_coherent(demo):
    ids = demo.encode_chat("What is the capital of France?")
    assert "Paris" in demo.decode_text(demo.generate(ids, max_new_tokens=16)[0])


def test_demo_cache_is_keyed_by_content_and_build(tmp_path, demo):
    """The key reads the GGUF's content, not its path or mtime; another build gets its own folder."""
    copy = str(tmp_path / "copy.gguf")
    shutil.copy(smollm2_gguf_path(), copy)
    os.utime(copy, (0, 0))
    assert loading.demo_key(copy) == loading.demo_key(smollm2_gguf_path())
    with open(copy, "r+b") as f:
        f.seek(os.path.getsize(copy) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert loading.demo_key(copy) != loading.demo_key(smollm2_gguf_path())
    assert demo.manifest["demo_build"] == loading.demo_key(smollm2_gguf_path())
    assert loading.demo_key(copy).startswith(f"{loading.DEMO_BUILD}-")


def test_concurrent_demo_builds_leave_one_complete_copy(tmp_path, monkeypatch):
    """Two builders racing for the same cache folder: both succeed, the folder is complete, and no
    staging folder is left behind."""
    monkeypatch.setenv("LOOKM_CACHE", str(tmp_path))
    manifest, params, tokenizer_json = loading.build_demo()
    small = {"text": {"embed": params["text"]["embed"][:4]}}
    monkeypatch.setattr(loading, "build_demo", lambda path=None: (manifest, small, tokenizer_json))
    target = str(tmp_path / "demo")
    errors = []

    def build():
        try:
            loading._build_demo_cache(smollm2_gguf_path(), target)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and store.is_converted(target)
    assert os.listdir(tmp_path) == ["demo"]


@pytest.mark.slow
def test_main_job_runs_offline_and_answers_from_the_pictures(capsys):
    assert cli.main(["generate", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert loading.DEMO_VISION_NOTE in out and "answer:" in out and "with 2 image(s)" in out
    assert "(128 image," in out and "ms/token" in out and "KV cache:" in out
    assert re.search(r"kept prompt \+ 4 new-token slots, of \d+ bucket \+ 4 new-token slots", out)
    # The default question asks the colour of the shape in picture 2: the answer names it.
    assert cli_args.DEFAULT_PROMPT.endswith("What colour is the shape in picture 2?")
    (shape,) = scenes.DEMO_SCENES[1].objects
    answer = re.search(r"^answer: (.*)$", out, re.MULTILINE).group(1)
    assert first_word(answer) == shape.colour, answer


def test_cli_reports_a_clear_error(capsys):
    assert cli.main(["generate", "--model", "/nonexistent/folder"]) == 2
    assert "not a folder or .gguf file" in capsys.readouterr().err

"""The `lookm` command: one line `lookm: error: ...` and exit 2 for every bad input (issue 12's table),
nothing written on disk when it fails, and the commands `methods`, `convert`, `--prompt-file`,
`--buckets`, option defaults in every help."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os

import numpy as np
import pytest

import lookm_jax
from lookm_jax import cli, cli_args, loading
from lookm_jax.convert import store
from lookm_jax.errors import InputError


@pytest.fixture
def cli_demo(demo, monkeypatch, tmp_path):
    """`lookm` with the (already loaded) demo model as its default, run in an empty folder."""
    monkeypatch.setattr(lookm_jax, "load_default", lambda dtype=None: dataclasses.replace(demo))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tree(*folders) -> set[str]:
    return {os.path.join(root, name) for folder in folders for root, dirs, files in os.walk(folder)
            for name in dirs + files}


def _fails(capsys, argv, *needles):
    """Runs `lookm argv`: exit 2, one stderr line naming the problem, no traceback, no file written."""
    capsys.readouterr()  # earlier output (progress bars) aside
    before = _tree(os.getcwd(), loading.cache_dir())
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err.split("\r")[-1]  # what a terminal shows once progress bars are erased
    assert code == 2, err
    assert err.startswith("lookm: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert _tree(os.getcwd(), loading.cache_dir()) == before
    return err


def test_unreadable_image(cli_demo, capsys):
    (cli_demo / "fake.png").write_text("a text file")
    _fails(capsys, ["generate", "--image", "fake.png"], "fake.png is not a readable image")


@pytest.mark.parametrize("command", [["generate"], ["plot", "attention", "--output", "a.png"]])
@pytest.mark.parametrize("images, markers", [(["--image", cli_args.DEFAULT_IMAGES[0]], 2), ([], 3)])  # [] = the demo's 2
def test_too_many_image_markers_are_refused_before_the_model_loads(cli_demo, capsys, monkeypatch, command, images,
                                                                   markers):
    monkeypatch.setattr(lookm_jax, "load_default", lambda dtype=None: pytest.fail("the model was loaded"))
    _fails(capsys, [*command, *images, "--prompt", " and ".join(["<image>"] * markers)],
           f"the prompt has {markers} <image> markers but {markers - 1} image(s) were given")


@pytest.mark.parametrize("argv,needles", [
    (["--method", "lookm", "--budget", "0"], ["budget must be a fraction in (0, 1], got 0"]),
    (["--method", "h2o", "--budget", "0"], ["budget must be a fraction in (0, 1], got 0"]),
    (["--method", "lookm", "--budget", "1.5"], ["got 1.5"]),
    (["--budget", "0.2"], ["method 'full' takes no budget"]),
    (["--method", "full", "--alpha-recent", "0.1"], ["method 'full' takes no alpha_recent"]),
    (["--method", "snapkv", "--budget", "-1"], ["got -1\n"]),
    (["--method", "snapkv", "--alpha-recent", "-0.5"], ["alpha_recent=-0.5"]),
    (["--method", "lookm", "--budget", "0.2", "--alpha-recent", "0.1"], ["either budget or alpha_recent"]),
    (["--method", "nope"], ["unknown method 'nope'; known: full, streamingllm"]),
    (["--budget", "abc"], ["argument --budget: invalid float value: 'abc'"]),
])
def test_bad_method_options(cli_demo, capsys, argv, needles):
    err = _fails(capsys, ["generate", *argv], *needles)
    assert "-0.5, -0.5" not in err


def test_budget_that_keeps_no_slot(cli_demo, capsys):
    _fails(capsys, ["generate", "--text-only", "--method", "lookm", "--budget", "0.01"],
           "keeps no slot of a 38-token prompt; the smallest budget that keeps one is 0.0527")


def test_max_new_tokens_beyond_the_context(cli_demo, capsys):
    _fails(capsys, ["generate", "--max-new-tokens", "100000"], "max_new_tokens=100000",
           "context length (8192, max_position_embeddings)", "--ignore-context-limit")


def test_long_prompt_file_is_read_and_the_bucket_error_says_how_to_raise_it(cli_demo, capsys):
    """70,000 words cannot go through argv, but --prompt-file reads them; too long for 16384."""
    (cli_demo / "long.txt").write_text(" ".join(["word"] * 70_000))
    _fails(capsys, ["generate", "--text-only", "--prompt-file", "long.txt"],
           "tokens is longer than the largest bucket (16384)", "--buckets 98304")


def test_prompt_file_problems(cli_demo, capsys):
    _fails(capsys, ["generate", "--prompt-file", "missing.txt"], "--prompt-file missing.txt: cannot be read")
    (cli_demo / "empty.txt").write_text("  \n")
    _fails(capsys, ["generate", "--prompt-file", "empty.txt"], "the prompt is empty")
    _fails(capsys, ["generate", "--prompt", "a", "--prompt-file", "empty.txt"], "not allowed with argument")
    _fails(capsys, ["generate", "--buckets", "0"], "argument --buckets: must be an integer >= 1, got 0")
    _fails(capsys, ["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0")
    _fails(capsys, ["eval"], "lookm eval: the following arguments are required: {milebench,needle,scenes}")
    _fails(capsys, ["generate", "--text-only", "--prompt", " "], "--prompt: the prompt is empty")
    _fails(capsys, ["generate", "--prompt", "\udcff hi"], "--prompt: the prompt is not valid UTF-8 text")  # argv's b"\xff"
    _fails(capsys, ["generate", "--text-only", "--image", "x.png"], "--text-only asks for no images")


@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number, got inf"),
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 4294967295], got -1"),
    (["--seed", str(2**70)], f"got {2**70}"),
    (["--model", ""], "argument --model: must be a path, got an empty string"),
])
def test_sampling_seed_and_model_arguments(cli_demo, capsys, argv, needle):
    _fails(capsys, ["generate", *argv], needle)


def test_prompt_from_stdin_in_an_extra_bucket(cli_demo, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?"))
    assert cli.main(["generate", "--text-only", "--prompt-file", "-", "--buckets", "48",
                     "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "capital of France" in out and "bucket 48;" in out
    assert "counting slots per layer and KV head (48 kept prompt + 3 new-token slots, of 48 bucket" in out


def test_methods_lists_every_method_with_parameters_and_defaults(capsys):
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in lookm_jax.METHODS:
        assert f"\n{name}: " in f"\n{out}"
        for param, default in lookm_jax.compression.methods.parameters(name).items():
            assert f"    {param} = {default!r}" in out
    assert "merge = 'pivotal'" in out and "window = 32" in out
    assert "budget=b sets alpha_recent = 0.5 b, alpha_important = 0.5 b" in out[out.index("\nh2o: "):]


def _parsers(parser, name="lookm"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_help_shows_its_default():
    for name, parser in _parsers(cli.build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                text = formatter._expand_help(action) if action.help else ""
                assert "default" in text, f"{name} {action.option_strings}: {text!r}"


def test_convert_then_load_gives_the_same_model(tiny_llava_folder, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "converted"
    assert cli.main(["convert", tiny_llava_folder, str(dst)]) == 0
    assert store.is_converted(str(dst)) and "converted" in capsys.readouterr().out
    ids = np.arange(1, 9)[None]
    np.testing.assert_array_equal(lookm_jax.load(str(dst)).logits(ids), lookm_jax.load(tiny_llava_folder).logits(ids))
    work = tmp_path / "work"
    (work / "bad").mkdir(parents=True)
    monkeypatch.chdir(work)
    _fails(capsys, ["convert", tiny_llava_folder, str(dst)], "exists; pass --force")
    _fails(capsys, ["convert", str(dst), "out"], "already a converted folder")
    _fails(capsys, ["convert", str(tmp_path / "none"), "out"], "not a folder or .gguf file")
    _fails(capsys, ["convert", str(work / "bad"), "out"], "no config.json")
    (work / "keep.txt").write_text("x")  # "" and "." name the working directory: never replaced
    _fails(capsys, ["convert", tiny_llava_folder, ""], "argument dst: must be a path, got an empty string")
    _fails(capsys, ["convert", tiny_llava_folder, ".", "--force"], ". is the working directory or holds it")
    _fails(capsys, ["convert", tiny_llava_folder, str(work), "--force"], "is the working directory or holds it")
    (work / "other").mkdir()
    (work / "other" / "notes.txt").write_text("x")
    _fails(capsys, ["convert", tiny_llava_folder, "other", "--force"], "neither a converted folder nor empty")
    with pytest.raises(InputError, match="the converted folder's path is empty"):
        lookm_jax.load(tiny_llava_folder).save("")
    assert sorted(os.listdir(work)) == ["bad", "keep.txt", "other"] and os.listdir(work / "other") == ["notes.txt"]
    assert cli.main(["convert", tiny_llava_folder, str(dst), "--force"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["converted", "work"]  # no temporary folder left


def test_convert_refuses_an_unwritable_destination_before_reading(tiny_llava_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setattr(loading, "read_checkpoint", lambda path: pytest.fail("the checkpoint was read first"))
    _fails(capsys, ["convert", tiny_llava_folder, "file.txt/out"], "file.txt/out: cannot write there",
           "file.txt is not a folder")
    if os.path.isdir("/proc"):  # the audit's case: no temporary folder's name, and no read of the checkpoint
        err = _fails(capsys, ["convert", tiny_llava_folder, "/proc/out"], "/proc/out: cannot write there")
        assert ".tmp-" not in err and "Errno" not in err, err
    assert os.listdir(tmp_path) == ["file.txt"]


def test_generate_refuses_a_converted_folder_whose_config_disagrees(tiny_llava_folder, tmp_path, capsys):
    dst = tmp_path / "converted"
    assert cli.main(["convert", tiny_llava_folder, str(dst)]) == 0
    manifest = json.loads((dst / store.MANIFEST).read_text())
    manifest["hf_config"]["text_config"]["num_hidden_layers"] = 10
    (dst / store.MANIFEST).write_text(json.dumps(manifest))
    _fails(capsys, ["generate", "--text-only", "--model", str(dst), "--prompt", "hi"],
           "text.layers.attn_norm has shape (2, 48)", "config implies (10, 48)")


def test_chat_answers_questions_from_stdin_on_one_compressed_context(cli_demo, capsys, monkeypatch):
    """`lookm chat` scripted through stdin: the cache size printed once, an answer a question; a bad
    question (a picture, one past the context length) gets one stderr line and the session goes on
    with its context: the same answers as a session without them. `generate
    --question-after-compression` answers the demo's question the same way."""
    options = ["--method", "lookm", "--budget", "0.5", "--max-new-tokens", "8"]
    questions = ["What colour is the shape in picture 2?", "What shape is in picture 1?"]
    too_long = "word " * 8200  # SmolLM2's context is 8192 positions

    def chat(lines):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
        assert cli.main(["chat", *options]) == 0
        return capsys.readouterr()

    clean = chat(questions)
    out = chat([questions[0], "", "Is <image> red?", too_long, questions[1]])
    assert out.out == clean.out and clean.err == ""
    lines = out.out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("context: 164 tokens (128 image, 36 text), bucket 192; method lookm")
    assert "(96 of 192 slots per layer and KV head kept)" in lines[0]
    assert lines[1] == "answer: Yellow."
    errors = out.err.splitlines()
    assert len(errors) == 2 and all(e.startswith("lookm: error: ") for e in errors)
    assert "a question cannot show pictures" in errors[0] and "passes the context length" in errors[1]
    assert cli.main(["generate", "--question-after-compression", *options]) == 0
    assert "answer: Yellow." in capsys.readouterr().out.splitlines()


def test_chat_refusals(cli_demo, capsys):
    (cli_demo / "fake.png").write_text("a text file")
    _fails(capsys, ["chat", "--image", "fake.png"], "fake.png is not a readable image")
    _fails(capsys, ["generate", "--question-after-compression", "--text-only", "--prompt", "Hello?"],
           "--question-after-compression needs a context")

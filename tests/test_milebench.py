"""MileBench harness: scoring as MileBench's evaluator, prompts and left truncation, resume, the CLI end to end.

The fixture (tests/fixtures/milebench/) is in MileBench's released layout: ActionLocalization (multi-choice,
with an -adv file), CLEVR-Change (adjacent images), MMCoQA ({table#k}), TextNeedleInAHaystack, GPR1200
(options without letters). The model is a tiny random HF LLaVA (25 image tokens per image) with a
character-level tokenizer, so token counts are character counts.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil

import pytest

from conftest import IMAGE_TOKEN, tiny_llava
from lookm_jax.errors import InputError
from lookm_jax.eval import harness
from lookm_jax.eval import milebench as mb
from lookm_jax.eval.milebench_scoring import (choice_letters, match_choice, multi_choice_correct, needle_correct,
                                              normalize, rouge_l, score, substring_correct)

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "milebench")


# ---- scoring ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("The Answer: (B).", "the answer: b"),  # "(" and ")" touch no space: replaced by spaces, then stripped
    ("x - y", "x  y"),  # a punctuation mark next to a space is deleted, not replaced
    ("1,000 apples!", "1000 apples"),  # a digit,digit group: every mark is deleted
    ("He paid 3.5 dollars.", "he paid 3.5 dollars"),  # periods before a digit survive
    ("'\"Quoted\"'", "quoted"),
    ("a\tb\nc", "a b c"),
    ("." * 40, "." * 8),  # MileBench passes re.UNICODE (32) as the count: 32 periods at most are removed
])
def test_normalize_like_milebench(text, expected):
    assert normalize(text) == expected


def test_needle_whole_word_and_mmcoqa_substring():
    assert needle_correct("The magic number is 4821.", "4821")
    assert not needle_correct("The magic number is 48210.", "4821")  # a word, not a substring
    assert substring_correct("It was France, in 1998.", "France")
    assert substring_correct("Frances", "France") and not needle_correct("Frances", "France")
    assert score("TextNeedleInAHaystack", "open-ended", "48210", "4821", None) == 0.0
    assert score("MMCoQA", "open-ended", "48210", "4821", None) == 1.0


@pytest.mark.parametrize("prediction, answer, expected", [
    ("the cat sat on the mat", "the cat is on the mat", 0.8),  # LCS {the, cat, on, mat}: P = R = 4/5
    ("a a a b", "a b", 1.0),  # counts are of distinct words (rouge 1.0.1, exclusive): P = 2/2, R = 2/2
    ("x y. z w", "y z", 2 * 0.5 / 1.5),  # union LCS over sentences {y} | {z}: R = 2/2, P = 2/4
    ("b a", "a b", 2 * 0.5 * 0.5 / 1.0),  # one word in common order: P = R = 1/2
    ("q r", "a b", 0.0),
    ("", "a b", 0.0),
    ("a b c", "a b c", 1.0),
])
def test_rouge_l_hand_computed(prediction, answer, expected):
    assert rouge_l(prediction, answer) == pytest.approx(expected, abs=1e-7)  # F carries a 1e-8 in the denominator


def test_open_ended_scores_rouge_of_normalized_text():
    assert score("IEdit", "open-ended", "The cat sat on the mat!", "the cat is on the mat.", None) == pytest.approx(0.8)


def test_multi_choice_matching_order_and_quirks():
    options = {"A": "red car", "B": "blue car", "C": "car"}
    assert match_choice("c car or b blue car", options) == "C"  # 1. "letter option", leftmost first
    assert match_choice("i think the blue car", options) == "B"  # 2. option text, spaces removed
    assert match_choice("b", options) == "B"  # 3. a bare letter
    assert match_choice("a or b", options) == "AB"  # 4. the option letters of the text, concatenated
    assert match_choice("", options) == "C"  # MileBench maps an empty prediction to "C"
    choices = ["red car", "blue car", "car"]
    assert multi_choice_correct("B. Blue car", "blue car", choices)
    assert multi_choice_correct("(B)", "blue car", choices)
    assert not multi_choice_correct("a or b", "blue car", choices)
    assert multi_choice_correct("", "car", choices)
    # Step 2 compares against the regex-escaped option: an option with "." never matches there.
    assert not multi_choice_correct("it weighs 3.5kg", "3.5 kg", ["1 kg", "3.5 kg"])
    assert multi_choice_correct("b 3.5 kg", "3.5 kg", ["1 kg", "3.5 kg"])
    with pytest.raises(ValueError, match="not among the choices"):
        multi_choice_correct("a", "green", choices)
    assert choice_letters(28)[25:] == ["Z", "[", "\\"]  # past Z as chr(65 + i), as MileBench (GPR1200)


def test_unknown_question_type_is_refused():
    with pytest.raises(ValueError, match="question_type"):
        score("WebQA", "yes-no", "a", "a", None)


# ---- data and prompts -------------------------------------------------------------------------------
def test_prompts_follow_milebench_layout():
    found = mb.find_datasets(FIXTURE)
    assert found == ["ActionLocalization", "CLEVR-Change", "MMCoQA", "TextNeedleInAHaystack", "GPR1200"]  # paper order
    al = mb.load_dataset(FIXTURE, "ActionLocalization")
    assert [s.sample_id for s in al] == [0, 1] and al[0].images[0].endswith("ActionLocalization/images/a0.png")
    assert mb.render(al[0].instruction, al[0].texts) == (
        "Given a series of video frames, answer the question about the action.\n"
        "<image>\n<image>\nWhen does the person open the door?\n"  # adjacent images get newlines
        "Choice list: \nA. At the start\nB. In the middle\nC. At the end\nYour answer is: ")
    assert mb.render(al[1].instruction, al[1].texts).startswith("Watch the frames and choose the right time span.\n")
    gpr = mb.load_dataset(FIXTURE, "GPR1200")[0]
    assert mb.render(gpr.instruction, gpr.texts).endswith(
        "Query: <image> Candidates: <image> <image>\nChoice list: \nThe first candidate\nThe second candidate\n"
        "Your answer is: ")
    mmcoqa = mb.load_dataset(FIXTURE, "MMCoQA")[0]
    assert mmcoqa.texts == ("Table: ", " Q: Who won the 1998 final? A:") and mmcoqa.choices is None
    adv = mb.load_dataset(FIXTURE, "ActionLocalization", adv=True)
    assert adv[0].choices == ("At the end", "In the middle", "At the start")
    assert mb.find_datasets(FIXTURE, adv=True) == ["ActionLocalization"]
    assert len(mb.load_dataset(FIXTURE, "ActionLocalization", limit=1)) == 1


def _edit_copy(tmp_path, name, edit):
    root = tmp_path / "mb"
    shutil.copytree(os.path.join(FIXTURE, name), root / name)
    path = root / name / f"{name}.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return str(root)


@pytest.mark.parametrize("name, edit, error, match", [
    ("MMCoQA", lambda d: d["meta_data"].update(question_type="yes-no"), ValueError, "question_type"),
    ("MMCoQA", lambda d: d["data"][0]["task_instance"]["images_path"].append("t0.png"), ValueError,
     "1 image placeholders in the context for 2 images"),
    ("MMCoQA", lambda d: d["data"][0]["task_instance"].update(images_path=["missing.png"]), InputError,
     r"sample 3: image \S*missing.png not found$"),
    ("MMCoQA", lambda d: d["data"][0].update(task_instruction_id=3), ValueError, "task_instruction_id 3"),
    ("MMCoQA", lambda d: d["data"][0].pop("response"), ValueError, "lacks \\['response'\\]"),
    ("ActionLocalization", lambda d: d["data"][0].update(response="Never"), ValueError, "not one of its choices"),
    ("ActionLocalization", lambda d: d["data"][1].update(sample_id=0), ValueError, "duplicate sample_id"),
    ("ActionLocalization", lambda d: d["data"].clear(), ValueError, "with at least one sample"),
    ("MMCoQA", lambda d: d["data"][0]["task_instance"].update(context="{table#1} and {image#2}: who won?"),
     InputError, r"sample 3: the context's \{image#2\} has no image \(images_path lists 1\)$"),
    ("MMCoQA", lambda d: d["data"][0].update(response=None), InputError,
     r"sample 3: response null is not a string or a number$"),
    ("MMCoQA", lambda d: d["data"][0]["task_instance"].update(images_path=[1]), ValueError,
     "a list of str 'images_path'"),
    ("MMCoQA", lambda d: d["data"][0]["task_instance"].update(images_path=[os.path.join(FIXTURE, "MMCoQA",
                                                                                        "MMCoQA.json")]),
     InputError, r"sample 3: image \S*MMCoQA.json is not a readable image \(UnidentifiedImageError"),
])
def test_bad_dataset_files_get_clear_errors(tmp_path, name, edit, error, match):
    root = _edit_copy(tmp_path, name, edit)
    with pytest.raises(error, match=match):
        mb.load_dataset(root, name)


def test_a_truncated_image_is_refused_when_the_dataset_is_read(tmp_path):
    root = _edit_copy(tmp_path, "MMCoQA", lambda d: None)
    image = os.path.join(root, "MMCoQA", "images", "t0.png")
    with open(image, "rb") as f:
        data = f.read()
    with open(image, "wb") as f:
        f.write(data[:-30])  # the header is whole: PIL opens it, decoding finds the pixels cut
    with pytest.raises(InputError, match=r"t0.png is not a readable image \(OSError: image file is truncated"):
        mb.load_dataset(root, "MMCoQA")


def test_missing_root_or_dataset_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        mb.find_datasets(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no MileBench datasets"):
        mb.find_datasets(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="WebQA.json"):
        mb.load_dataset(FIXTURE, "WebQA")


# ---- the tiny model ---------------------------------------------------------------------------------
def _char_tokenizer():
    """Printable ASCII + newline, one token per character; "<image>" is the image token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate([chr(c) for c in range(32, 127)] + ["\n", "[UNK]"])}
    vocab["<image>"] = IMAGE_TOKEN
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    return tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llava_milebench")
    tiny_llava(folder)  # 30 px images in 6 px patches: 25 image tokens each
    _char_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30}}))
    return str(folder)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    import lookm_jax

    return lookm_jax.load(tiny_folder)


def _as_text(model, ids) -> str:
    """Ids back to text, each image's run of placeholder tokens as one "<image>"."""
    tokens = [model.tokenizer.id_to_token(int(i)) for i in ids]
    text = "".join(tokens)
    return text.replace("<image>" * model.config.image_seq_length, "<image>")


def test_left_truncation_keeps_instruction_and_question(tiny):
    from lookm_jax.generate import PromptTooLongError

    sample = mb.load_dataset(FIXTURE, "TextNeedleInAHaystack")[0]
    n_image = tiny.config.image_seq_length
    full_text = mb.render(sample.instruction, sample.texts)
    full = mb.build_prompt(tiny, sample, 10_000)
    assert not full.truncated and full.images == sample.images
    assert full.input_ids.shape[1] == len(full_text) - 3 * len("<image>") + 3 * n_image
    protected = len(mb.render(sample.instruction, sample.texts[-1:]))
    head = sample.instruction + "\n"
    context = full_text[len(head):]
    for limit in [full.input_ids.shape[1] - 1, *range(protected, full.input_ids.shape[1], 9)]:
        prompt = mb.build_prompt(tiny, sample, limit)
        length = prompt.input_ids.shape[1]
        text = _as_text(tiny, prompt.input_ids[0])
        kept = text[len(head):]
        assert prompt.truncated and length <= limit
        assert text.startswith(head) and context.endswith(kept) and kept.endswith(sample.texts[-1])
        assert kept.count("<image>") == len(prompt.images) and prompt.images == sample.images[3 - len(prompt.images):]
        assert (prompt.input_ids[0] == IMAGE_TOKEN).sum() == n_image * len(prompt.images)
        # The longest suffix: short of the limit only when the next piece was a whole image.
        assert limit - length < n_image and (length == limit or context[: len(context) - len(kept)].endswith("<image>"))
    assert len(mb.build_prompt(tiny, sample, protected).images) == 0
    with pytest.raises(PromptTooLongError, match="the instruction and question alone"):
        mb.build_prompt(tiny, sample, protected - 1)


# ---- the command, end to end ------------------------------------------------------------------------
def _cli(tiny_folder, out, *extra):
    from lookm_jax.cli import main

    return main(["eval", "milebench", FIXTURE, "--model", tiny_folder, "--datasets", "ActionLocalization",
                 "--method", "h2o", "--budget", "0.5", "--max-new-tokens", "3", "--output", str(out), *extra])


class Interrupted(Exception):
    """Stands for Ctrl-C or a crash in the middle of a run (pytest reserves KeyboardInterrupt)."""


def test_cli_end_to_end_with_interruption_and_resume(tiny_folder, tmp_path, monkeypatch, capsys):
    from lookm_jax.model import Model

    out = tmp_path / "out"
    calls, interrupt_at = [], [2]  # the first run dies at its second sample
    real_run = Model.run

    def interrupted_run(self, *args, **kwargs):
        calls.append(1)
        if interrupt_at and len(calls) == interrupt_at[0]:
            interrupt_at.clear()
            raise Interrupted
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Model, "run", interrupted_run)
    with pytest.raises(Interrupted):
        _cli(tiny_folder, out)
    lines = (out / mb.PREDICTIONS).read_text().splitlines()
    assert len(lines) == 1 and not (out / mb.GROUPS_CSV).exists()
    first = json.loads(lines[0])
    assert first["dataset"] == "ActionLocalization" and first["sample_id"] == 0
    assert first["method"] == "H2O(alpha_recent=0.25, alpha_important=0.25)" and first["images_kept"] == 2
    assert first["image_tokens"] == 50 and first["score"] == score(
        "ActionLocalization", "multi-choice", first["prediction"], "In the middle", first["choices"])

    calls.clear()
    assert _cli(tiny_folder, out) == 0
    assert len(calls) == 1  # only the sample the interruption lost
    records = [json.loads(line) for line in (out / mb.PREDICTIONS).read_text().splitlines()]
    assert records[0] == first and [r["sample_id"] for r in records] == [0, 1]
    captured = capsys.readouterr()
    assert "resuming: 1 of 2 samples" in captured.out and "sample/s" in captured.err  # the tqdm bar
    assert "MileBench by group" in captured.out

    # A kill in the middle of a write leaves half a line: the rerun drops it and redoes that sample.
    text = (out / mb.PREDICTIONS).read_text()
    (out / mb.PREDICTIONS).write_text(text[: len(text) - 40])
    calls.clear()
    assert _cli(tiny_folder, out) == 0 and len(calls) == 1
    assert "incomplete last line" in capsys.readouterr().out
    assert [json.loads(line)["sample_id"] for line in (out / mb.PREDICTIONS).read_text().splitlines()] == [0, 1]

    # The adversarial file is another config (resume never mixes them); same shapes, so no new compile.
    calls.clear()
    assert _cli(tiny_folder, out, "--adv") == 0 and len(calls) == 2
    with open(out / mb.GROUPS_CSV, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == [*mb.CONFIG_FIELDS, *mb.GROUPS, "overall", "samples"] and len(rows) == 2
    records = [json.loads(line) for line in (out / mb.PREDICTIONS).read_text().splitlines()]
    for row, adv in zip(rows, ("False", "True")):
        expected = 100 * sum(r["score"] for r in records if r["adv"] == (adv == "True")) / 2
        assert row["adv"] == adv and float(row["T-1"]) == pytest.approx(expected, abs=0.01)
        assert float(row["overall"]) == float(row["T-1"]) and row["S-1"] == "" and row["samples"] == "2"
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


def test_cli_bad_input_writes_nothing(tiny_folder, tmp_path, capsys):
    from lookm_jax.cli import main

    out = tmp_path / "out"
    assert main(["eval", "milebench", str(tmp_path / "nowhere"), "--output", str(out)]) == 2
    assert "lookm: error:" in capsys.readouterr().err and not out.exists()
    assert main(["eval", "milebench", FIXTURE, "--limit", "0", "--output", str(out)]) == 2
    assert "--limit" in capsys.readouterr().err and not out.exists()
    assert main(["eval", "milebench", FIXTURE, "--model", tiny_folder, "--max-new-tokens", "8",
                 "--max-prompt-tokens", "100000", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--max-prompt-tokens must be in 1.." in err and "context length less --max-new-tokens" in err
    assert not out.exists()
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURE, broken)
    for image in broken.rglob("*.png"):
        image.write_bytes(image.read_bytes()[:40])  # truncated: the first sample fails
    assert main(["eval", "milebench", str(broken), "--model", tiny_folder, "--datasets", "ActionLocalization",
                 "--max-new-tokens", "4", "--output", str(out)]) == 2
    assert "not a readable image" in capsys.readouterr().err and not out.exists()


# ---- tables -----------------------------------------------------------------------------------------
def _record(method, dataset, sample_id, value):
    return {"model": "m", "method": method, "dtype": "float32", "max_new_tokens": 8, "max_prompt_tokens": 64,
            "adv": False, "dataset": dataset, "sample_id": sample_id, "score": value}


def test_summary_groups_and_overall(tmp_path):
    records = [_record("Full()", "ActionLocalization", 0, 1.0), _record("Full()", "ActionLocalization", 1, 0.0),
               _record("Full()", "ActionPrediction", 0, 1.0), _record("Full()", "GPR1200", 0, 0.0),
               _record("Full()", "MyOwnSet", 0, 1.0), _record("LookM()", "WebQA", 0, 0.25)]
    full, lookm = mb.summarize(records)
    assert full.datasets == {"ActionLocalization": 50.0, "ActionPrediction": 100.0, "GPR1200": 0.0, "MyOwnSet": 100.0}
    assert full.groups == {"T-1": 75.0, "IR": 0.0} and full.overall == 37.5 and full.samples == 5
    assert lookm.groups == {"S-1": 25.0} and lookm.overall == 25.0
    header, lines = mb.table([full, lookm], "datasets")
    assert header[len(mb.CONFIG_FIELDS):] == ["ActionLocalization", "ActionPrediction", "WebQA", "GPR1200",
                                              "MyOwnSet", "samples"]
    assert lines[1][len(mb.CONFIG_FIELDS):] == [None, None, 25.0, None, None, 1]
    path = str(tmp_path / "t.csv")
    harness.write_table(path, header, lines)
    assert open(path).read().splitlines()[2].endswith(",,,25.0,,,1")


def test_corrupt_predictions_file_is_named(tmp_path):
    path = tmp_path / mb.PREDICTIONS
    path.write_text(json.dumps(_record("Full()", "WebQA", 0, 1.0)) + "\n{oops\n")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        mb.read_predictions(str(path))


@pytest.mark.parametrize("change, message", [
    ({"score": "high"}, r'line 2: score "high" is not a number in \[0, 1\]$'),
    ({"score": None}, r"line 2: score null is not a number in \[0, 1\]$"),
    ({"score": 42.0}, r"line 2: score 42.0 is not a number in \[0, 1\]$"),
    ({"dataset": ["x"]}, r'line 2: dataset \["x"\] is not a string$'),
    ({"sample_id": "1"}, r'line 2: sample_id "1" is not an integer$'),
    ({"adv": 0}, r"line 2: adv 0 is not true or false$"),
    ({"dtype": "float16"}, r'line 2: dtype "float16" is not one of "float32", "bfloat16"$'),
    ({"max_new_tokens": 0}, r"line 2: max_new_tokens 0 is not an integer >= 1$"),
])
def test_bad_prediction_records_are_named_by_field(tmp_path, change, message):
    path = tmp_path / mb.PREDICTIONS
    path.write_text(json.dumps(_record("Full()", "WebQA", 0, 1.0)) + "\n"
                    + json.dumps({**_record("Full()", "WebQA", 1, 0.5), **change}) + "\n")
    with pytest.raises(InputError, match=message):
        mb.read_predictions(str(path))


def test_a_bad_record_refuses_the_rerun_and_repeated_datasets_are_refused(tiny_folder, tmp_path, capsys):
    """A sample_id written as a string would make its sample look not done (generated and counted
    twice): the resume refuses the file and writes nothing; so does a dataset named twice."""
    from lookm_jax.cli import main

    out = tmp_path / "out"
    out.mkdir()
    record = {**_record("H2O(alpha_recent=0.25, alpha_important=0.25)", "ActionLocalization", "0", 1.0),
              "model": os.path.abspath(tiny_folder), "max_new_tokens": 3}
    text = json.dumps(record) + "\n"
    (out / mb.PREDICTIONS).write_text(text)
    assert _cli(tiny_folder, out) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r'lookm: error: \S*predictions.jsonl, line 1: sample_id "0" is not an integer', err), err
    assert os.listdir(out) == [mb.PREDICTIONS] and (out / mb.PREDICTIONS).read_text() == text
    assert main(["eval", "milebench", FIXTURE, "--datasets", "MMCoQA", "GPR1200", "MMCoQA", "--output",
                 str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.strip() == "lookm: error: --datasets repeats MMCoQA: give each value once"
    assert not (tmp_path / "new").exists()
    (tmp_path / "fake.png").write_text("x")  # an --output below a file: refused before anything runs
    assert main(["eval", "milebench", FIXTURE, "--output", str(tmp_path / "fake.png" / "sub")]) == 2
    assert "fake.png is a file, not a folder" in capsys.readouterr().err


def test_the_question_asked_after_compression(tiny_folder, tmp_path, capsys):
    """--ask-after-compression: the context up to the last image compressed alone, the question
    prefilled onto it; with the full cache the predictions equal the question-in-prompt run's. Its
    records are a config of their own (an "asked" column), beside records written before the field."""
    import lookm_jax

    def run(*extra):
        from lookm_jax.cli import main

        assert main(["eval", "milebench", FIXTURE, "--model", tiny_folder, "--datasets", "ActionLocalization",
                     "--max-new-tokens", "3", "--output", str(tmp_path), *extra]) == 0

    run()
    run("--ask-after-compression")
    records = mb.read_predictions(str(tmp_path / mb.PREDICTIONS))
    assert [r["asked"] for r in records] == ["in prompt"] * 2 + ["after compression"] * 2
    assert [r["prediction"] for r in records[:2]] == [r["prediction"] for r in records[2:]]
    assert records[2]["prompt_tokens"] == records[0]["prompt_tokens"] and records[2]["image_tokens"] == 50
    old = {k: v for k, v in records[0].items() if k != "asked"}
    assert mb.record_config(old) == mb.record_config(records[0])
    prompt = mb.build_prompt(lookm_jax.load(tiny_folder), mb.load_dataset(FIXTURE, "ActionLocalization")[0], 10_000)
    assert 0 < prompt.question_start < prompt.input_ids.shape[1]
    assert (prompt.input_ids[0, prompt.question_start:] != 250).all()  # the question: text after the last image


# ---- a grid processor (Qwen2-VL): each picture's tokens depend on its size ------------------------------
@pytest.fixture(scope="module")
def grid_model_and_fixture(tmp_path_factory):
    """A tiny Qwen2-VL and a copy of the fixture whose needle pictures have three different sizes."""
    import lookm_jax
    from tests.test_qwen2_vl import SIZES, _images, tiny_qwen2_vl

    folder = tmp_path_factory.mktemp("tiny_qwen2_vl_milebench")
    tiny_qwen2_vl(folder)
    root = tmp_path_factory.mktemp("milebench_sizes")
    for name in ("TextNeedleInAHaystack", "ActionLocalization"):
        shutil.copytree(os.path.join(FIXTURE, name), root / name)
    for name in ("TextNeedleInAHaystack", "ActionLocalization"):
        pictures = sorted(os.listdir(root / name / "images"))
        for picture, image in zip(pictures, _images(SIZES[:len(pictures)])):
            image.save(root / name / "images" / picture)
    return lookm_jax.load(str(folder)), str(folder), str(root)


def test_grid_processor_prompts_count_each_picture_s_own_tokens(grid_model_and_fixture):
    """Left truncation drops whole pictures, each costing its own placeholder tokens (its grid), and the
    prompt carries the kept pictures' grids for `encode_chat` and the pixels."""
    import lookm_jax
    from tests.test_qwen2_vl import IMAGE_TOKEN as PAD

    model, _, root = grid_model_and_fixture
    sample = mb.load_dataset(root, "TextNeedleInAHaystack")[0]
    grids = mb.image_tiles(model, sample.images)
    placeholders = [t * h * w // 4 for t, h, w in grids]
    assert len(set(placeholders)) == 3
    full = mb.build_prompt(model, sample, 10_000)
    assert (full.input_ids == PAD).sum() == sum(placeholders) and full.image_tiles == tuple(grids)
    seen = []
    for limit in range(full.input_ids.shape[1] - 1, 0, -7):
        try:
            prompt = mb.build_prompt(model, sample, limit)
        except lookm_jax.PromptTooLongError:
            break
        k = len(prompt.images)
        seen.append(k)
        assert prompt.truncated and prompt.input_ids.shape[1] <= limit
        assert prompt.images == sample.images[3 - k:] and prompt.image_tiles == tuple(grids[3 - k:])
        assert (prompt.input_ids == PAD).sum() == sum(placeholders[3 - k:])
    assert set(seen) >= {0, 1, 2} and seen == sorted(seen, reverse=True)  # a lower limit never keeps more


def test_grid_processor_end_to_end_in_prompt_and_after_compression(grid_model_and_fixture, tmp_path):
    from lookm_jax.cli import main

    _, folder, root = grid_model_and_fixture
    for extra in ([], ["--ask-after-compression"]):
        assert main(["eval", "milebench", root, "--model", folder, "--datasets", "ActionLocalization", "--method",
                     "lookm", "--budget", "0.5", "--max-new-tokens", "3", "--output", str(tmp_path), *extra]) == 0
    records = mb.read_predictions(str(tmp_path / mb.PREDICTIONS))
    assert len(records) == 4 and len({r["image_tokens"] for r in records}) > 1  # pictures of different sizes
    assert [r["image_tokens"] for r in records[:2]] == [r["image_tokens"] for r in records[2:]]


def test_every_cut_of_a_onevision_prompt_carries_its_own_pictures_tiles(tmp_path_factory):
    """LLaVA-OneVision tiles the picture of a one-picture prompt (anyres) and not those of a several-picture
    one, so a cut prompt's tiles are those of its kept pictures preprocessed together, never a slice of the
    whole prompt's; every cut fits its limit, a larger limit never keeps fewer pictures (a lone tiled
    picture costs more than two untiled ones), and one runs."""
    import lookm_jax
    from tests.test_llava_onevision import tiny_onevision

    folder = tmp_path_factory.mktemp("tiny_onevision_milebench")
    tiny_onevision(folder)
    model = lookm_jax.load(str(folder))
    sample = mb.load_dataset(FIXTURE, "TextNeedleInAHaystack")[0]
    assert mb.image_tiles(model, sample.images[-1:]) != mb.image_tiles(model, sample.images)[-1:]  # tiled alone
    full = mb.build_prompt(model, sample, 10_000)
    kept = []
    for limit in range(31, full.input_ids.shape[1]):
        prompt = mb.build_prompt(model, sample, limit)
        kept.append(len(prompt.images))
        assert prompt.input_ids.shape[1] <= limit
        assert prompt.image_tiles == tuple(mb.image_tiles(model, prompt.images))
    assert set(kept) >= {0, 2} and kept == sorted(kept)
    pixels = model.preprocess_images([mb.open_image(p).convert("RGB") for p in prompt.images])[0]
    assert model.run(prompt.input_ids, pixels, max_new_tokens=2).tokens.shape == (1, 2)

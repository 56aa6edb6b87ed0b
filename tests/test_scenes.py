"""Scenes: the generator's questions, the `lookm eval scenes` benchmark, and what the trained tower sees."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re

import numpy as np
import pytest

from lookm_jax import scenes
from lookm_jax.eval import harness, scenes as bench


def test_training_split_never_draws_the_held_out_pair():
    drawn = {(o.colour, o.shape) for i in range(400) for o in scenes.single_picture_sample("train", 0, i, 3).scene.objects}
    assert scenes.HELD_OUT not in drawn and len(drawn) == 4 * 3 - 1
    combination = scenes.single_picture_sample("combination", 0, 0)
    assert scenes.HELD_OUT in {(o.colour, o.shape) for o in combination.scene.objects}


def test_conversation_turns_do_not_answer_each_other():
    """Each object is the subject of one question at most (any question about it puts its colour
    and shape in the text), the count is asked once at most; the same holds across pictures."""
    for i in range(300):
        sample = scenes.single_picture_sample("train", 0, i, 3)
        subjects = [q.subject for q in sample.questions if q.kind != "count"]
        assert len(subjects) == len(set(subjects)) and sum(q.kind == "count" for q in sample.questions) <= 1
        assert 1 <= len(sample.questions) <= min(3, len(sample.scene.objects) + 1)
        multi = scenes.multi_picture_sample("train", 0, i, 8, 3)
        pictures = [q.subject for q in multi.questions if q.subject is not None]
        assert len(pictures) == len(set(pictures)) and len({q.text for q in multi.questions}) == len(multi.questions)


def test_answers_follow_the_drawn_objects():
    for i in range(50):
        sample = scenes.single_picture_sample("heldout", 0, i, 3)
        for q in sample.questions:
            if q.kind == "count":
                assert q.answer == scenes.NUMBERS[len(sample.scene.objects)]
            else:
                o = sample.scene.objects[q.subject]
                assert q.answer in (o.colour, o.shape, "left", "right", "top", "bottom")
        multi = scenes.multi_picture_sample("bench", 0, i, 5, 1, kinds=("picture_colour",))
        q = multi.questions[0]
        assert f"picture {q.subject + 1}" in q.text and q.answer == multi.scenes[q.subject].objects[0].colour


def test_a_text_fact_turn_asks_about_its_sentence_and_leaves_the_rest_as_it_was():
    for i in range(100):
        plain = scenes.multi_picture_sample("train", 0, i, 5, 3)
        sample = scenes.multi_picture_sample("train", 0, i, 5, 3, text_fact=True)
        assert sample.scenes == plain.scenes and plain.fact is None
        (fact_q,) = [q for q in sample.questions if q.kind == "text_fact"]
        others = [q for q in sample.questions if q.kind != "text_fact"]
        assert others == list(plain.questions[:2]) and len(sample.questions) <= 3
        k, sentence = sample.fact
        assert sentence.endswith(f" is {fact_q.answer}.") and fact_q.answer.isdigit() and len(fact_q.answer) == 4
        subject = sentence.split()[4]  # "The code of the {subject} is {number}."
        assert subject in fact_q.text and subject in scenes.FACT_SUBJECTS
        prompt = sample.prompt(sample.questions[0])
        assert f"Picture {k}: <image>\n{sentence}\n" in prompt and prompt.count("<image>") == 5
    assert "magic" not in scenes.FACT_SENTENCE  # apart from the needle benchmark's wording


def test_every_bench_sample_asks_its_task():
    """Pictures that cannot answer a task (e.g. no unique colour-shape pair) are redrawn."""
    for kind in scenes.MULTI_KINDS:
        for i in range(60):
            assert [q.kind for q in scenes.multi_picture_sample("bench", 0, i, 8, 1, kinds=(kind,)).questions] == [kind]


def test_scoring_reads_the_first_word_or_the_needle():
    assert bench.is_correct("yellow", "Yellow.") and not bench.is_correct("yellow", "The shape is yellow.")
    assert bench.is_correct("picture 3", "Picture 3.") and not bench.is_correct("picture 3", "Picture 13.")
    assert bench.is_correct("4821", "The number is 4821.") and not bench.is_correct("4821", "48210")


def test_a_count_is_read_from_the_last_number_word_of_the_first_sentence():
    """Counts answered alone, listing the pictures first (`scenes.listed_count`) or going through them
    with a running count (`scenes.tallied_count`) score alike."""
    assert bench.is_correct("three", "Three.") and bench.is_correct("three", "2,5,7: three.")
    assert bench.is_correct("zero", "None: zero.") and bench.is_correct("one", "4: one. Two more")
    assert not bench.is_correct("three", "2,5,7: two.") and not bench.is_correct("three", "2,5,7,")
    assert not bench.is_correct("two", "Three. Two")
    shapes = ("circle", "square", "circle", "triangle", "square", "circle", "square")
    q = lambda counted: scenes.Question("count_pictures", "", scenes.NUMBERS[len(counted)], counted=counted,  # noqa: E731
                                        shapes=shapes)
    assert [scenes.listed_count(q(c)) for c in ((), (3,), (1, 4, 6))] == ["None: zero.", "4: one.", "2,5,7: three."]
    assert scenes.spoken_answer(q((1, 4, 6)), "listed") == "2,5,7: three."
    tallied = ("1 circle (zero), 2 square (one), 3 circle (one), 4 triangle (one), 5 square (two), 6 circle (two), "
               "7 square (three): three.")
    assert scenes.spoken_answer(q((1, 4, 6)), "tallied") == tallied and bench.is_correct("three", tallied)
    assert scenes.tallied_count(q((3,))).endswith("4 triangle (one), 5 square (one), 6 circle (one), 7 square (one): one.")
    assert not bench.is_correct("two", tallied)
    assert not bench.is_correct("one", "1 circle (zero), 2 square (one)") and not bench.is_correct("one", "2 square (one")
    assert bench.is_correct("zero", scenes.tallied_count(q(())))
    assert scenes.spoken_answer(q((1, 4, 6))) == "Three." == scenes.spoken_answer(
        dataclasses.replace(q((1,)), kind="count", answer="three"), "tallied")
    with pytest.raises(ValueError, match="count_form must be one of"):
        scenes.spoken_answer(q(()), "spelled")
    with pytest.raises(ValueError, match="needs every picture's shape"):
        scenes.tallied_count(dataclasses.replace(q((1,)), shapes=()))
    # the benchmark's own count questions carry every picture's shape, and their counts agree with it
    for i in range(20):
        question = bench.task_sample("count_pictures", 8, 0, i).questions[0]
        asked = question.text.split()[-1].rstrip("?")
        assert question.counted == tuple(k for k, shape in enumerate(question.shapes) if shape == asked)
        assert len(question.shapes) == 8 and bench.is_correct(question.answer, scenes.tallied_count(question))


def test_every_task_prompt_is_mostly_image_tokens(demo):
    for task in bench.TASKS:
        for prompt in bench.task_prompts(demo, task, 8, 3, seed=0):
            ids, _ = harness.encode_batch(demo, [prompt.text])
            image = int((ids == demo.config.image_token_id).sum())
            assert prompt.pixel_values.shape == (8, 3, 112, 112) and prompt.text.count("<image>") == 8
            assert image == 8 * demo.config.image_seq_length and image / ids.shape[1] >= 0.75, (task, image, ids.shape)
            if task == "needle":
                assert f"is {prompt.answer}." in prompt.text
            else:
                assert "Picture 8: <image>" in prompt.text and prompt.answer == prompt.answer.lower()


def test_rows_written_before_the_asked_field_count_as_asked_in_the_prompt():
    """A JSONL from before `asked` existed resumes and summarises as questions in the prompt: its row
    and a new one for the same sample are one sample, and neither is an after-compression row."""
    old = {"seed": 0, "pictures": 3, "task": "picture_colour", "sample": 0, "label": "full", "budget": 1.0}
    new = {**old, "asked": "in prompt"}
    after = {**old, "asked": "after compression"}
    configs = [harness.SweepConfig("full", 1.0)]
    assert harness.row_key(old, bench.KEY_FIELDS, bench.KEY_DEFAULTS) == harness.row_key(new, bench.KEY_FIELDS)
    assert bench.select_rows([old, new, after], configs, ["picture_colour"], [3], 1, 0) == [old]
    assert bench.select_rows([old, new, after], configs, ["picture_colour"], [3], 1, 0, "after compression") == [after]


def test_trained_pairs_keep_the_bench_samples_without_the_held_out_pair():
    """pairs="trained" asks the first n bench samples whose pictures hold no green triangle, under their
    own bench index (so their rows are the same rows as an all-pairs run's), and skips the others;
    the needle's samples and the "all" selection are unchanged; the held-out single-picture questions
    keep cycling the four kinds."""
    every = [bench.task_sample("which_picture", 8, 0, i) for i in range(40)]
    clean = [i for i, s in enumerate(every) if not s.shows(scenes.HELD_OUT)]
    assert 5 < len(clean) < 35  # about half of 8 pictures hold one: both kinds are present
    assert bench.sample_indices("which_picture", 8, 5, 0, "trained") == clean[:5]
    assert bench.sample_indices("which_picture", 8, 5, 0) == bench.sample_indices("needle", 8, 5, 0, "trained") == list(range(5))
    row = lambda i: {"seed": 0, "pictures": 8, "task": "which_picture", "sample": i, "label": "full", "budget": 1.0}  # noqa: E731
    rows = [row(i) for i in range(40)]
    configs = [harness.SweepConfig("full", 1.0)]
    assert [r["sample"] for r in bench.select_rows(rows, configs, ["which_picture"], [8], 5, 0, pairs="trained")] == clean[:5]
    questions = bench.held_out_questions("heldout", 40, pairs="trained")
    assert not any(scene.shows(scenes.HELD_OUT) for scene, _ in questions)
    assert [q.kind for _, q in questions] == [scenes.KINDS[i % 4] for i in range(40)]
    assert any(scene.shows(scenes.HELD_OUT) for scene, _ in bench.held_out_questions("heldout", 40))
    with pytest.raises(ValueError, match="pairs must be one of"):
        bench.sample_indices("which_picture", 8, 5, 0, "seen")
    with pytest.raises(ValueError, match="every scene"):
        bench.held_out_questions("combination", 4, pairs="trained")


def test_a_question_asked_after_compression_is_cut_from_the_whole_chat(demo):
    """The prefilled part ends where the question starts: prefilled + fed tokens = the whole chat."""
    for task, pictures in [(task, 3) for task in scenes.MULTI_KINDS] + [("needle", 6)]:
        prompts = bench.task_prompts(demo, task, pictures, 2, seed=0, asked="after compression")
        ids, mask, after = harness.encode_asked_after(demo, prompts)
        for r, p in enumerate(prompts):
            assert p.after and not p.text.endswith(p.after)
            assert p.text.endswith(f"Picture {pictures}: <image>\n" if task != "needle" else "\n\n")
            whole = demo.encode_chat(p.text + p.after)[0]
            head, tail = ids[r, :mask[r].sum()], after[r][after[r] >= 0]
            np.testing.assert_array_equal(np.concatenate([head, tail]), whole)
            assert p.after in demo.decode_text(tail)
            assert (head == demo.config.image_token_id).sum() == pictures * 64


def test_answers_cut_at_max_new_tokens_are_reported(demo, tmp_path):
    """An answer that has not ended when max_new_tokens runs out is scored as cut, and the run says so."""
    logged = []
    prompts = bench.task_prompts(demo, "which_picture", 3, 2, seed=0)
    harness.run_prompts(demo, [harness.SweepConfig("full", 1.0)], [prompts], str(tmp_path / "rows.jsonl"),
                        bench.KEY_FIELDS, bench.is_correct, schema=bench.ROW_SCHEMA, max_new_tokens=1,
                        log=logged.append)
    assert "warning: 2 answers were cut at max_new_tokens=1" in logged[-1], logged
    harness.run_prompts(demo, [harness.SweepConfig("full", 1.0)], [prompts], str(tmp_path / "more.jsonl"),
                        bench.KEY_FIELDS, bench.is_correct, schema=bench.ROW_SCHEMA, max_new_tokens=12,
                        log=logged.append)
    assert "warning" not in logged[-1], logged  # "Picture 3." ends well within 12 tokens
    harness.run_prompts(demo, [harness.SweepConfig("full", 1.0)], [prompts[:1], prompts[1:]],
                        str(tmp_path / "per_batch.jsonl"), bench.KEY_FIELDS, bench.is_correct, schema=bench.ROW_SCHEMA,
                        max_new_tokens=[12, 1], log=logged.append)
    assert "warning: 1 answers were cut at max_new_tokens=1 before" in logged[-1], logged  # one limit per batch
    for bad in ([12, 1], [0], 0, True):  # a count of limits other than the batches', or a limit < 1
        with pytest.raises(ValueError, match=r"max_new_tokens must be one int >= 1 or one per batch \(1 batches\)"):
            harness.run_prompts(demo, [harness.SweepConfig("full", 1.0)], [prompts], str(tmp_path / "bad.jsonl"),
                                bench.KEY_FIELDS, bench.is_correct, schema=bench.ROW_SCHEMA, max_new_tokens=bad)


@pytest.mark.parametrize("pictures", [2, 8, 16])
def test_a_tallied_count_fits_the_default_token_limit(demo, pictures):
    """A count answered picture by picture, and its end-of-turn token, fit the tokens a run gives it."""
    longest = max(len(demo.tokenizer.encode(scenes.tallied_count(bench.task_sample("count_pictures", pictures, 0, i)
                                                                   .questions[0])).ids) for i in range(30))
    assert longest + 1 <= bench.answer_tokens("count_pictures", pictures), longest
    assert bench.answer_tokens("describe", pictures) == 24


@pytest.mark.slow
def test_eval_scenes_end_to_end_resumes_and_reports(demo, tmp_path, capsys):
    from lookm_jax.cli import main

    jsonl, table = str(tmp_path / "rows.jsonl"), str(tmp_path / "scenes.csv")
    argv = ["eval", "scenes", "sweep", "--tasks", "picture_colour", "which_picture", "--pictures", "3",
            "--samples", "2", "--batch-size", "2", "--methods", "h2o", "--budgets", "0.5", "--max-new-tokens", "4",
            "--jsonl", jsonl, "--output", table]
    assert main(argv) == 0
    lines = open(jsonl).read().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 2 * 2 * 2  # tasks x samples x (full, H2O)
    assert {(r["task"], r["label"]) for r in rows} == {(t, c) for t in ("picture_colour", "which_picture")
                                                      for c in ("full", "H2O")}
    assert all(r["correct"] == bench.is_correct(r["answer"], r["output"]) for r in rows)
    assert all(r["fidelity"] == 1.0 for r in rows if r["label"] == "full")
    # Interrupted in the middle of writing the last batch: the rerun redoes that batch alone.
    with open(jsonl, "w") as f:
        f.write("\n".join(lines[:4]) + "\n" + lines[4][:30])
    assert main(argv) == 0
    assert open(jsonl).read().splitlines()[:4] == lines[:4]
    again = [json.loads(line) for line in open(jsonl).read().splitlines()]
    assert len(again) == len(rows) and [r["output"] for r in again] == [r["output"] for r in rows]
    capsys.readouterr()
    assert main(argv + ["--report-only", "--compare", "H2O"]) == 0
    out = capsys.readouterr().out
    assert "accuracy per task" in out and "| H2O minus | budget | picture_colour | which_picture | all |" in out
    assert re.search(r"\| full \| 0.5 \| [+-]\d\.\d\d ± ", out), out
    assert main(argv + ["--report-only", "--compare", "h2o"]) == 2  # a label, not a method name
    assert "--compare 'h2o' is none of the configs' labels: ['H2O', 'full']" in capsys.readouterr().err
    with open(table) as f:
        summary = list(csv.DictReader(f))
    assert tuple(summary[0]) == harness.CSV_COLUMNS and len(summary) == 2
    assert {int(r["samples"]) for r in summary} == {4} and len({r["length"] for r in summary}) == 1
    # The same samples asked after compression: rows of their own, beside the first ones.
    assert main(argv + ["--ask-after-compression"]) == 0
    after = [json.loads(line) for line in open(jsonl).read().splitlines()][len(rows):]
    assert len(after) == len(rows) and {r["asked"] for r in after} == {"after compression"}
    assert all(r["prompt_tokens"] < first["prompt_tokens"] for r, first in zip(after, rows))


def test_paired_differences_over_the_questions_both_configs_answered():
    """A minus B at each budget over the shared samples, per task and over all, with the standard error
    of the paired differences; B's extra sample and another budget's rows do not count; the full
    cache is compared at every budget of A's."""
    def row(label, budget, task, sample, correct):
        return {**ROW, "label": label, "method": label.lower(), "budget": budget, "task": task, "sample": sample,
                "correct": correct}

    a = [row("A", 0.1, task, i, c) for task, answers in (("t1", [1, 1, 0, 1]), ("t2", [0, 1, 1, 1]))
         for i, c in enumerate(answers)]
    b = [row("B", 0.1, task, i, c) for task, answers in (("t1", [0, 1, 0, 0, 1]), ("t2", [0, 0, 1, 1]))
         for i, c in enumerate(answers)]
    full = [{**r, "label": "full", "method": "full", "budget": 1.0} for r in b]
    differences = bench.paired_differences(a + b + [row("B", 0.2, "t1", 0, 0)] + full, "A")
    found = {d["task"]: d for d in differences if d["label"] == "B"}
    assert {(d["label"], d["budget"]) for d in differences} == {("B", 0.1), ("full", 0.1)}
    assert set(found) == {"t1", "t2", "all"}
    for task, diffs in (("t1", [1, 0, 0, 1]), ("t2", [0, 1, 0, 0]), ("all", [1, 0, 0, 1, 0, 1, 0, 0])):
        assert found[task]["samples"] == len(diffs)
        np.testing.assert_allclose(found[task]["difference"], np.mean(diffs))
        np.testing.assert_allclose(found[task]["standard_error"], np.std(diffs, ddof=1) / np.sqrt(len(diffs)))
    table = bench.format_differences(differences, "A")
    assert "| B | 0.1 | +0.50 ± 0.29 | +0.25 ± 0.25 | +0.38 ± 0.18 |" in table


@pytest.mark.parametrize("argv, message", [
    (["--pictures", "1"], "--pictures must each be in [2, 16], got [1]"),
    (["--pictures", "17"], "--pictures must each be in [2, 16], got [17]"),
    (["--samples", "0"], "need --samples, --batch-size and --max-new-tokens >= 1"),
    (["--methods", "bogus"], "unknown methods ['bogus']"),
    (["--budgets", "0"], "budgets must be fractions in (0, 1]"),
    (["--tasks", "needle", "--pictures", "3"], "the needle task needs --pictures >= 6, got 3"),
    (["--max-decode-rows", "0"], "--max-decode-rows must be >= 1, got 0"),
    (["--pictures", "3", "4", "3"], "--pictures repeats 3: give each value once"),
    (["--tasks", "needle", "picture_colour", "needle"], "--tasks repeats needle: give each value once"),
    (["--budgets", "0.5", "0.5"], "--budgets repeats 0.5: give each value once"),
])
def test_eval_scenes_refuses_bad_arguments_in_one_line(argv, message, tmp_path, capsys, demo):
    """`demo` builds the cached demo first: the needle's check needs the model's tokenizer, and a first
    build's progress bar would otherwise come before the one line (run alone, the test failed so)."""
    from lookm_jax.cli import main

    jsonl = tmp_path / "rows.jsonl"
    assert main(["eval", "scenes", "sweep", "--jsonl", str(jsonl), "--output", str(tmp_path / "t.csv"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not jsonl.exists()


def test_picture_benchmarks_refuse_a_text_only_model_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    import lookm_jax
    from lookm_jax.cli import main
    from lookm_jax.model import Model

    text_only = Model(tiny.text_config, {"text": tiny.params["text"]}, tiny.manifest, tiny.tokenizer)
    monkeypatch.setattr(lookm_jax, "load", lambda *args: text_only)
    for argv, message in ((["scenes", "calibrate"], "the scenes benchmark needs a multimodal"),
                          (["needle", "calibrate", "--lengths", "100"], "; pass --text-only for the text needle")):
        jsonl = tmp_path / "rows.jsonl"
        assert main(["eval", *argv, "--model", "m", "--jsonl", str(jsonl), "--output", str(tmp_path / "t.csv")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "text-only" in err and len(err.splitlines()) == 1, err
        assert os.listdir(tmp_path) == []


def test_report_only_without_rows_is_refused(tmp_path, capsys):
    """A missing JSONL is named as missing; one without rows for these settings as holding none."""
    from lookm_jax.cli import main

    argv = ["eval", "scenes", "calibrate", "--report-only", "--output", str(tmp_path / "t.csv"), "--jsonl"]
    assert main([*argv, str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"lookm: error: --jsonl \S*none.jsonl does not exist \(--report-only .*\)", err), err
    (tmp_path / "empty.jsonl").write_text("")
    assert main([*argv, str(tmp_path / "empty.jsonl")]) == 2
    assert "empty.jsonl holds no rows for these settings" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["empty.jsonl"]


ROW = {"label": "full", "method": "full", "text_prior": "", "merge": "", "budget": 1.0, "correct": True,
       "fidelity": 1.0, "seed": 0, "pictures": 8, "task": "needle", "sample": 0, "prompt_tokens": 600}


@pytest.mark.parametrize("change, message", [
    ({"prompt_tokens": None}, r"line 2: not a benchmark row \(a JSON object with .*\): no prompt_tokens$"),
    ({"asked": "later"}, r'line 2: asked "later" is not one of "in prompt", "after compression"$'),
    ({"pictures": "8"}, r'line 2: pictures "8" is not an integer >= 0$'),
    ({"task": ["needle"]}, r'line 2: task \["needle"\] is not a string$'),
    ({"correct": 1}, r"line 2: correct 1 is not true or false$"),
])
def test_a_bad_row_is_refused_in_one_line_naming_its_field(tmp_path, capsys, change, message):
    """Rows are checked field by field when read (`asked` may be absent: rows written before it);
    the refusal writes no summary."""
    from lookm_jax.cli import main

    jsonl = tmp_path / "rows.jsonl"
    bad = {k: v for k, v in {**ROW, **change}.items() if v is not None}
    jsonl.write_text(json.dumps(ROW) + "\n" + json.dumps(bad) + "\n")
    argv = ["eval", "scenes", "calibrate", "--report-only", "--tasks", "needle", "--pictures", "8", "--samples", "1",
            "--jsonl", str(jsonl), "--output", str(tmp_path / "t.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert os.listdir(tmp_path) == ["rows.jsonl"]
    jsonl.write_text(json.dumps(ROW) + "\n")
    assert main(argv) == 0 and (tmp_path / "t.csv").exists()


def test_an_output_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys):
    from lookm_jax.cli import main

    argv = ["eval", "scenes", "calibrate", "--jsonl", str(tmp_path / "rows.jsonl"), "--output"]
    assert main([*argv, str(tmp_path / "nowhere" / "t.csv")]) == 2
    assert re.search(r"--output \S*t.csv: folder \S*nowhere does not exist$", capsys.readouterr().err.strip())
    assert main([*argv, str(tmp_path)]) == 2
    assert re.search(r"--output \S* is a folder", capsys.readouterr().err)
    assert not os.listdir(tmp_path)


def test_unreadable_rows_and_a_summary_over_its_rows_are_refused(tmp_path, capsys):
    """A JSONL line that is not a row is named by its line; --output equal to --jsonl would overwrite
    the rows; each refusal leaves the files as they were."""
    from lookm_jax.cli import main

    jsonl, output = tmp_path / "rows.jsonl", tmp_path / "t.csv"
    row = ROW
    no_key = json.dumps({k: v for k, v in row.items() if k != "seed"})
    for bad, message in (('{"label": "full", "bud', "line 2: not JSON"), ("[1, 2]", "line 2: not a benchmark row"),
                         (no_key, "line 2: not a benchmark row")):
        jsonl.write_text(json.dumps(row) + "\n" + bad + "\n")
        argv = ["eval", "scenes", "calibrate", "--report-only", "--jsonl", str(jsonl), "--output", str(output)]
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert main(["eval", "scenes", "calibrate", "--jsonl", str(jsonl), "--output", str(jsonl)]) == 2
    assert "--jsonl and --output are the same file" in capsys.readouterr().err
    assert jsonl.read_text().endswith(no_key + "\n") and sorted(os.listdir(tmp_path)) == ["rows.jsonl"]


def test_shipped_tower_beats_chance_on_held_out_questions(demo):
    """60 held-out single-picture questions (15 per kind), greedy, full cache, against answering
    uniformly at random among each kind's answers. The issue's bar (>= 95%) is NOT met by the
    shipped weights (0.88 of 600 held-out questions: colour 0.89, shape 0.83, count 0.94, position
    0.87; docs/RESULTS.md): this guards what they do see, overall, in every kind, and on pictures of
    one object (0.98 of the 203 among the 600); most misses are questions about one object of several
    (0.80 of 294, `binding`)."""
    result = bench.single_picture_accuracy(demo, "heldout", 60)
    options = {"colour": len(scenes.COLOURS), "shape": len(scenes.SHAPES), "count": scenes.MAX_OBJECTS, "position": 2}
    chance = sum(1 / options[k] for k in result["by_kind"]) / len(result["by_kind"])
    print(f"held-out {result['accuracy']:.2f} {result['by_kind']} (chance {chance:.2f}) by objects "
          f"{result['by_objects']}, binding {result['binding']:.2f}")
    assert result["accuracy"] >= chance + 0.30, result
    assert all(result["by_kind"][k] > 1 / options[k] for k in options), result
    assert set(result["by_objects"]) == {1, 2, 3} and result["by_objects"][1] >= 0.9, result
    assert 0 <= result["binding"] <= 1, result


def test_merge_traffic_accounts_for_every_evicted_pair(tiny):
    import math

    from conftest import image_ids
    from lookm_jax import analysis, get_method

    per_image = tiny.config.image_seq_length
    ids = image_ids(per_image, [3, 4, "img", 5, 6, 7, "img", 8, 9, 10, 11])[None]
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    length, text = ids.shape[1], 9
    method = get_method("lookm", budget=0.2, merge="pivotal")
    counts = analysis.merge_traffic(tiny, ids, pixels, np.ones(ids.shape, bool), method)
    traffic = analysis.traffic_shares(counts)
    heads = tiny.config.text.num_layers * tiny.config.text.num_kv_heads
    kept_per_head = 2 * math.floor(0.1 * length)
    assert counts["kept"] == heads * kept_per_head and counts["evicted"] == heads * (length - kept_per_head)
    # Text-prior keeps every text token (9 < 2 x 6 slots), so only image pairs are evicted.
    assert traffic["evicted_image"] == 1.0 and traffic["text_slots"] == text / kept_per_head
    text_slots, image_slots = heads * text, heads * (kept_per_head - text)
    absorbed = traffic["absorbed_text"] * text_slots + traffic["absorbed_image"] * image_slots
    assert absorbed == pytest.approx(counts["evicted"])
    assert counts["absorbed_by_text"] == counts["image_into_text"]  # every source is an image pair
    assert 0 <= counts["image_into_recent_text"] <= counts["image_into_text"] <= counts["evicted_image"]
    assert -1 <= traffic["cosine_image_image"] <= 1
    with pytest.raises(ValueError, match="needs a merging LOOK-M"):
        analysis.merge_traffic(tiny, ids, pixels, np.ones(ids.shape, bool), get_method("lookm", budget=0.2, merge=None))


def test_kept_per_picture_counts_every_kept_image_slot(tiny):
    """Two pictures between text: per layer, row and head the pictures' counts add up to the kept
    image slots, and with picture balance the quota's slots split evenly between them."""
    import chex
    import jax.numpy as jnp

    from conftest import image_ids
    from lookm_jax import analysis, get_method

    per_image = tiny.config.image_seq_length
    ids = image_ids(per_image, [3, 4, "img", 5, 6, 7, "img", 8, 9, 10, 11])[None]
    pixels = np.random.default_rng(0).standard_normal((2, 3, 30, 30)).astype(np.float32)
    valid = np.ones(ids.shape, bool)
    method = get_method("lookm_quota", budget=0.5, recent_share=0.25, image_quota="proportional", picture_balance=True,
                        text_window=False)  # a plain window, over picture 2's last tokens
    kept = analysis.kept_per_picture(tiny, ids, pixels, valid, method)  # [N, 1, Hkv, 2]
    n_recent, n_important = (int(x[0]) for x in method.budgets(jnp.asarray(valid)))
    is_image = ids[0] == tiny.config.image_token_id
    window_images = int(is_image[-n_recent:].sum())  # kept by the recent window: picture 2's last tokens
    candidates, images = ids.shape[1] - n_recent, int(is_image[:-n_recent].sum())
    reserved = n_important * images // candidates
    assert reserved + int((~is_image[:-n_recent]).sum()) >= n_important  # text takes the rest: only the quota keeps images
    chex.assert_shape(kept, (tiny.config.text.num_layers, 1, tiny.config.text.num_kv_heads, 2))
    assert (kept.sum(-1) == reserved + window_images).all(), kept
    assert (np.abs(kept[..., 0] - (kept[..., 1] - window_images)) <= 1).all(), kept
    with pytest.raises(ValueError, match="pools its heads"):
        analysis.kept_per_picture(tiny, ids, pixels, valid, get_method("adakv", budget=0.5))


@pytest.mark.slow
def test_decoder_ceiling_bench_describes_scenes_and_scores_content(tmp_path):
    """bench/decoder_ceiling.py: the words it gives the decoder are the scene's, its content scorer reads the
    first answer-vocabulary word, and the script runs end to end on a few questions."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "bench"))
    try:
        import decoder_ceiling
    finally:
        sys.path.pop(0)
    scene, question = bench.held_out_questions("heldout", 1)[0]
    text = decoder_ceiling.describe(scene)
    assert all(f"a {o.colour} {o.shape} at the " in text for o in scene.objects)
    assert scenes.NUMBERS[len(scene.objects)] in text.split()[3]
    colour_q = scenes.Question("colour", "What colour is the circle?", "red")
    assert decoder_ceiling.content_answer("The circle is a red circle, not blue.", colour_q) == "red"
    assert decoder_ceiling.content_answer("It is round.", colour_q) == ""
    side_q = scenes.Question("position", "Is the red circle left or right?", "left")
    assert decoder_ceiling.content_answer("The red circle is at the top, on the left.", side_q) == "left"

    out = tmp_path / "ceiling.json"
    proc = subprocess.run([sys.executable, "bench/decoder_ceiling.py", "--samples", "4", "--max-new-tokens", "4",
                           "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = subprocess.run([sys.executable, "bench/decoder_ceiling.py", "--json", str(tmp_path / "none" / "x.json")],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "argument --json: must be a file in an existing folder" in bad.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"plain", "one-word instruction"}
    for by_rule in results.values():
        assert set(by_rule["content"]) == {"all", *scenes.KINDS} and 0 <= by_rule["content"]["all"] <= 1


def test_stage_two_kinds_answer_from_the_picture_they_name():
    """"describe" names picture k's colour, shape and place; "picture_position" its side or half
    (pictures too near that midline are never asked); a description is scored on colour and shape."""
    assert scenes.describe(scenes.SceneObject("red", "circle", 0.2, 0.2, 0.1)) == "a red circle at the top left"
    assert scenes.describe(scenes.SceneObject("blue", "square", 0.5, 0.8, 0.1)) == "a blue square at the bottom"
    assert scenes.describe(scenes.SceneObject("green", "triangle", 0.9, 0.5, 0.1)) == "a green triangle on the right"
    assert scenes.describe(scenes.SceneObject("yellow", "circle", 0.5, 0.5, 0.1)) == "a yellow circle in the middle"
    for kind in ("describe", "picture_position"):
        for i in range(40):
            sample = scenes.multi_picture_sample("bench", 0, i, 8, 1, kinds=(kind,))
            (q,) = sample.questions
            o = sample.scenes[q.subject].objects[0]
            assert f"picture {q.subject + 1}" in q.text.lower()
            if kind == "describe":
                assert q.answer == scenes.describe(o)
            else:
                value = o.x if "left" in q.text else o.y
                assert abs(value - 0.5) >= 0.14 and q.answer == {"left": ("left", "right"), "top": ("top", "bottom")}[
                    "left" if "left" in q.text else "top"][int(value > 0.5)]
    assert bench.is_correct("a red circle at the top left", "A red circle at the bottom.")
    assert not bench.is_correct("a red circle at the top left", "A blue circle, next to a red square.")
    assert not bench.is_correct("a red circle at the top left", "Red.")
    assert bench.is_correct("left", "Left.") and "describe" in bench.TASKS

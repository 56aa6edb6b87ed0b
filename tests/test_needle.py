"""Prefill once / compress per method (generate.py, sweep.generate_methods) and the needle benchmark."""

from __future__ import annotations

import csv
import json
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lookm_jax
from conftest import IMAGE_TOKEN, image_ids
from lookm_jax import KVCache, generate as gen, get_method, sweep
from lookm_jax.errors import InputError
from lookm_jax.eval import harness, needle
from lookm_jax.compression.methods import Method
from lookm_jax.compression.scoring import STATISTICS

# Every kind of input a method reads: the last W = M queries (SnapKV as LOOK-M ran it), two
# statistics (RoCo), sums + merging without text-prior (LOOK-M). Equal capacity (24 slots).
METHODS = {
    "snapkv-w=M": get_method("snapkv", budget=0.4, window=None, kernel_size=5, pooling="avg"),
    "roco": get_method("roco", budget=0.4, std_weight=0.5),
    "lookm-weighted-no-prior": get_method("lookm", budget=0.4, merge="weighted", text_prior=False),
}
NEW = 6


@pytest.fixture(scope="module")
def ragged_batch(tiny):
    """Two right-padded rows with 2 and 1 images of 25 tokens: L = 59 and 33, bucket 64."""
    rows = [image_ids(tiny.config.image_seq_length, [3, 4, "img", 5, 6, 7, "img", 8, 9, 10, 11]),
            image_ids(tiny.config.image_seq_length, [12, "img", 13, 14, 15, 16, 17, 18])]
    ids = np.zeros((2, 59), np.int32)
    mask = np.zeros((2, 59), bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, True
    pixels = np.random.default_rng(0).standard_normal((3, 3, 30, 30)).astype(np.float32)
    return ids, pixels, mask


@pytest.fixture(scope="module")
def prefilled(tiny, ragged_batch):
    """(prefill args, `prefill_states` of the ragged batch), with what METHODS read: both statistics,
    the last W = floor(0.2 * 64) = 12 queries."""
    ids, pixels, mask = ragged_batch
    packed, valid = gen.pack_prompts(ids, mask)
    args = (tiny.config, tiny.params, jnp.asarray(packed), jnp.asarray(valid), jnp.asarray(pixels),
            jax.random.key(0))
    assert max(gen.query_window(m, 64) for m in METHODS.values()) == 12
    return args, gen.prefill_states(*args, statistics=STATISTICS, window=12, sampling=gen.Sampling())


def test_one_prefill_gives_every_method_the_cache_and_tokens_of_run(tiny, ragged_batch, prefilled):
    """On ragged rows with images, one shared prefill gives each method the cache that
    `Model.run(..., method=m)` decodes from (same kept positions, keys, values, cursor, first token),
    and `sweep.generate_methods` the same greedy tokens as `Model.run`, with the methods decoded
    together in chunks of two methods (4 rows) and one."""
    ids, pixels, mask = ragged_batch
    args, prefilled = prefilled
    chex.assert_shape(prefilled.keys, (2, 2, 2, 64, 12))  # [N, B, Hkv, L, D]
    shared_tokens = sweep.generate_methods(tiny, ids, pixels, mask, max_new_tokens=NEW, methods=list(METHODS.values()),
                                          max_decode_rows=4)
    for (name, method), tokens in zip(METHODS.items(), shared_tokens):
        np.testing.assert_array_equal(tokens, tiny.run(ids, pixels, mask, NEW, method=method).tokens, err_msg=name)
        compiled_prefill, _ = next(v for k, v in tiny._compiled.items() if k[2] == method and k[3] == NEW)
        first, cache, _ = compiled_prefill(*args[1:])  # the integrated path's own program
        shared = gen.compress_prefilled(prefilled, method=method, max_new_tokens=NEW)
        chex.assert_trees_all_equal_shapes_and_dtypes(shared, cache)
        np.testing.assert_array_equal(prefilled.first, first, err_msg=name)
        np.testing.assert_array_equal(shared.positions, cache.positions, err_msg=name)
        np.testing.assert_allclose(shared.keys, cache.keys, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(shared.values, cache.values, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(shared.cursor, cache.cursor)
        np.testing.assert_array_equal(shared.next_position, cache.next_position)
        # The budget really evicts: row 0 keeps floor(.2 * 59) * 2 = 22 of its 59 tokens.
        np.testing.assert_array_equal((shared.positions[:, 0] >= 0).sum(-1), 22)


def test_tokens_fed_after_compression_continue_the_prompt(tiny, ragged_batch):
    """Text tokens prefilled onto the cache after compression (`after`, a different count per row)
    answer as if they had ended the prompt: with the full cache, the same greedy tokens as
    `Model.run` on the whole prompt."""
    ids, pixels, mask = ragged_batch
    lengths, fed = mask.sum(1), np.array([4, 3])  # text tokens only: the last picture ends before them
    head_mask = np.arange(ids.shape[1])[None] < (lengths - fed)[:, None]
    after = np.full((2, 5), -1, np.int32)
    for r in range(2):
        after[r, :fed[r]] = ids[r, lengths[r] - fed[r]:lengths[r]]
    whole = tiny.run(ids, pixels, mask, NEW).tokens
    full, lookm = sweep.generate_methods(tiny, np.where(head_mask, ids, 0), pixels, head_mask, NEW, after=after,
                                         methods=[get_method("full"), get_method("lookm", budget=0.4)])
    np.testing.assert_array_equal(full, whole)
    chex.assert_shape(lookm, (2, NEW))
    with pytest.raises(InputError, match="at least one token per row"):
        sweep.generate_methods(tiny, ids, pixels, mask, NEW, after=np.full((2, 2), -1, np.int32),
                               methods=[get_method("full")])
    with pytest.raises(InputError, match="right-padded with -1"):
        sweep.generate_methods(tiny, ids, pixels, mask, NEW, after=np.array([[3, -1, 4], [3, 4, 5]], np.int32),
                               methods=[get_method("full")])
    for bad in (np.array([[3], [4]], np.float32), np.array([3, 4], np.int32), [[3, 4]]):  # float, 1-D, one row
        with pytest.raises(InputError, match=r"after must be integer ids \[2, A\]"):
            sweep.generate_methods(tiny, ids, pixels, mask, NEW, after=bad, methods=[get_method("full")])
    with pytest.raises(InputError, match=r"after holds ids outside the vocabulary \[0, 251\): first 10000000"):
        sweep.generate_methods(tiny, ids, pixels, mask, NEW, after=np.array([[10**7], [5]]),
                               methods=[get_method("full")])
    with pytest.raises(InputError, match="methods must be a non-empty list of methods"):
        sweep.generate_methods(tiny, ids, pixels, mask, NEW, methods=get_method("full"))
    for rows in (2.5, 0, None):
        with pytest.raises(InputError, match=f"max_decode_rows must be an int >= 1, got {rows}"):
            sweep.generate_methods(tiny, ids, pixels, mask, NEW, methods=[get_method("full")], max_decode_rows=rows)
    with pytest.raises(InputError, match=r"input_ids must be"):  # the prompt named before `after` is measured by it
        sweep.generate_methods(tiny, 5, after=[[1]], methods=[get_method("full")])


def test_compress_prefilled_refuses_what_the_prefill_did_not_keep(prefilled):
    _, prefilled = prefilled
    sums_only = prefilled.replace(stats={"sums": prefilled.stats["sums"]})
    with pytest.raises(ValueError, match="needs attention statistics"):
        gen.compress_prefilled(sums_only, method=METHODS["roco"], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="reads the last 32 queries"):
        gen.compress_prefilled(prefilled, method=get_method("snapkv", budget=0.4), max_new_tokens=NEW)

    class Unknown(Method):
        def capacity(self, bucket_len):
            return bucket_len

        def __call__(self, queries, keys, values, is_image, valid, stats=None):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="Unknown is not known"):
        gen.query_window(Unknown(), 64)


def test_concat_caches_stacks_rows_and_refuses_unequal_capacities(prefilled):
    _, prefilled = prefilled
    a = gen.compress_prefilled(prefilled, method=METHODS["roco"], max_new_tokens=NEW)
    b = gen.compress_prefilled(prefilled, method=get_method("h2o", budget=0.2), max_new_tokens=NEW)
    with pytest.raises(ValueError, match="equal capacity"):
        KVCache.concat_rows([a, b])
    both = KVCache.concat_rows([a, a])
    chex.assert_shape(both.positions, (2, 4) + a.positions.shape[2:])
    np.testing.assert_array_equal(both.positions[:, 2:], a.positions)
    np.testing.assert_array_equal(both.next_position, np.tile(a.next_position, 2))


# ---- needle samples -------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1024, 2048])
def test_samples_fit_their_length_with_images_over_70_percent(demo, length):
    per_image = demo.config.image_seq_length
    samples = needle.make_samples(demo.tokenizer, length, 5, seed=3, image_seq_length=per_image)
    assert [s.depth for s in samples] == list(needle.DEFAULT_DEPTHS)
    for s in samples:
        ids = demo.encode_chat(s.prompt)[0]
        is_image = ids == demo.config.image_token_id
        assert length - 48 <= len(ids) <= length  # never spills into the next bucket
        assert is_image.mean() >= 0.7 and is_image.sum() == per_image * s.num_images == per_image * s.context.count("<image>")
        word = re.fullmatch(r"What is the special magic number for (\w+)\? .*", s.question).group(1)
        assert s.context.count("special magic number") == 1 and re.fullmatch(r"\d{4}", s.answer)
        assert f"The special magic number for {word} is {s.answer}." in s.context
        assert s.prompt.endswith(s.question) and s.prompt.startswith(s.context)
        # The needle sits at about `depth` of the context (its tokens, images included): within half
        # an image, as it goes to the sentence boundary nearest the target.
        key = demo.tokenizer.encode(" special magic number for", add_special_tokens=False).ids
        found = [i for i in range(len(ids)) if list(ids[i:i + len(key)]) == key]  # needle, question
        prefix = 24  # the chat template's system turn and "<|im_start|>user\n"
        assert len(found) == 2
        assert abs((found[0] - prefix) / (found[1] - prefix) - s.depth) < 128 / length + 0.02, (found, s.depth)


def test_samples_are_deterministic_and_text_only_has_no_images(demo):
    a = needle.make_samples(demo.tokenizer, 1024, 3, seed=0, image_seq_length=demo.config.image_seq_length)
    assert a == needle.make_samples(demo.tokenizer, 1024, 3, seed=0, image_seq_length=demo.config.image_seq_length)
    assert a != needle.make_samples(demo.tokenizer, 1024, 3, seed=1, image_seq_length=demo.config.image_seq_length)
    text = needle.make_samples(demo.tokenizer, 1024, 3, seed=0)
    assert all(s.num_images == 0 and "<image>" not in s.prompt for s in text)
    assert all(1024 - 48 <= demo.encode_chat(s.prompt).shape[1] <= 1024 for s in text)
    with pytest.raises(ValueError, match="length 300 leaves -?[0-9]+ text tokens beside 4 image.* the next length that "
                                         "fits is") as refused:
        needle.make_samples(demo.tokenizer, 300, 1, seed=0, image_seq_length=demo.config.image_seq_length)
    fitting = int(str(refused.value).rsplit(" ", 1)[1])
    assert 300 < fitting and all(len(needle.make_samples(demo.tokenizer, fitting, 20, seed,
                                                    image_seq_length=demo.config.image_seq_length)) == 20
                                 for seed in range(3))  # every needle word fits
    with pytest.raises(ValueError, match="no length up to 131072 fits; use a smaller image_fraction"):
        needle.make_samples(demo.tokenizer, 300, 1, seed=0, image_seq_length=demo.config.image_seq_length,
                            image_fraction=0.99)
    with pytest.raises(ValueError, match="depths"):
        needle.make_samples(demo.tokenizer, 1024, 1, seed=0, depths=(1.5,))


@pytest.mark.parametrize("generated,correct", [
    ("4821", True), ("The special magic number for lotus is 4821.", True), ("4,821", False),
    ("48210", False), ("14821", False), ("482", False), ("", False), ("1234 and 4821", True)])
def test_exact_match_needs_the_four_digits_as_a_whole_number(generated, correct):
    assert needle.is_correct("4821", generated) is correct


def test_sweep_configs_cover_every_method_and_lookm_variant():
    configs = harness.sweep_configs(lookm_jax.METHODS, harness.DEFAULT_BUDGETS)
    assert len(configs) == 1 + 4 * (7 + 8) and configs[0].label == "full"
    labels = {c.label for c in configs}
    assert {"H2O", "SnapKV", "PyramidKV", "AdaKV", "RoCo", "StreamingLLM", "LOOK-M (text-prior, pivotal)",
            "LOOK-M (no text-prior, no merge)", "LOOK-M + image quota"} <= labels and len(labels) == 1 + 7 + 8
    lookm = configs[-2].build()  # the last of LOOK-M's variants; lookm_quota comes after them
    assert (lookm.text_prior, lookm.merge, lookm.alpha_recent) == (False, "weighted", 0.25)
    with pytest.raises(ValueError, match="unknown methods"):
        harness.sweep_configs(["h2o", "bogus"], [0.1])
    with pytest.raises(ValueError, match="budgets"):
        harness.sweep_configs(["h2o"], [0.0])


def test_sweep_configs_take_methods_with_options():
    spec = "lookm:image_quota=proportional,merge_scope=same_modality,size_aware=True,merge=averaged"
    configs = harness.sweep_configs(["h2o", spec, "h2o:layer_split=3/1"], [0.1, 0.2])
    assert [c.label for c in configs] == ["full"] + ["H2O", spec, "h2o:layer_split=3/1"] * 2
    lookm = configs[2].build()
    assert (lookm.image_quota, lookm.merge_scope, lookm.size_aware, lookm.merge, lookm.alpha_recent) == (
        "proportional", "same_modality", True, "averaged", 0.05)
    assert configs[3].build().layer_split == (3.0, 1.0)
    with pytest.raises(InputError, match="takes no colour"):
        harness.sweep_configs(["lookm:colour=red"], [0.1])
    with pytest.raises(ValueError, match="unknown method in spec"):
        harness.sweep_configs(["bogus:a=1"], [0.1])
    with pytest.raises(ValueError, match="options are key=value"):
        harness.sweep_configs(["lookm:merge"], [0.1])


# ---- the sweep on the tiny model ------------------------------------------------------------------



@pytest.mark.slow
def test_sweep_rows_match_run_and_a_rerun_resumes(tiny_with_tokenizer, tmp_path):
    model = tiny_with_tokenizer
    configs = needle.sweep_configs(["h2o"], [0.3])
    jsonl = str(tmp_path / "rows.jsonl")
    kwargs = dict(image_fraction=0.3, batch_size=2, max_new_tokens=4)
    rows = needle.run_sweep(model, configs, [200], 4, 0, jsonl, **kwargs)
    assert len(rows) == 2 * 4 and {r["images"] for r in rows} == {2}
    assert all(r["fidelity"] == 1.0 for r in rows if r["method"] == "full")
    # Sample 3 with H2O, independently through Model.run.
    sample = needle.make_samples(model.tokenizer, 200, 4, 0, image_seq_length=25, image_fraction=0.3)[3]
    ids = model.encode_chat(sample.prompt)
    pixels = needle._pixel_values(model, 2)
    h2o = model.run(ids, pixels, max_new_tokens=4, method=configs[1].build()).tokens[0]
    full = model.run(ids, pixels, max_new_tokens=4).tokens[0]
    row = next(r for r in rows if r["sample"] == 3 and r["label"] == "H2O")
    assert row["output"] == model.decode_text(h2o) and row["fidelity"] == np.mean(h2o == full)
    assert row["correct"] == needle.is_correct(sample.answer, row["output"]) and row["prompt_tokens"] == ids.shape[1]
    # A rerun appends nothing; a row cut short by an interrupted write is redone alone.
    lines = open(jsonl).read().splitlines()
    assert needle.run_sweep(model, configs, [200], 4, 0, jsonl, **kwargs) == rows
    with open(jsonl, "w") as f:
        f.write("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    again = needle.run_sweep(model, configs, [200], 4, 0, jsonl, **kwargs)
    assert open(jsonl).read().splitlines() == lines and again == rows
    # The summary CSV, from the command's report mode: exactly the agreed columns, a row per config and length.
    from lookm_jax.cli import main

    path = str(tmp_path / "sweep.csv")
    assert main(["eval", "needle", "sweep", "--lengths", "200", "--samples", "4", "--methods", "h2o",
                 "--budgets", "0.3", "--jsonl", jsonl, "--output", path, "--report-only"]) == 0
    with open(path) as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == harness.CSV_COLUMNS and len(table) == 2
    assert {(r["label"], r["budget"], r["samples"]) for r in table} == {("full", "1.0", "4"), ("H2O", "0.3", "4")}
    assert float(next(r for r in table if r["label"] == "full")["fidelity"]) == 1.0


def test_report_refuses_rows_with_different_picture_counts_at_one_length():
    configs = needle.sweep_configs(["h2o"], [0.3])
    row = {"seed": 0, "length": 200, "sample": 0, "label": "full", "budget": 1.0, "images": 2}
    rows = [row, {**row, "sample": 1, "images": 3}, {**row, "length": 300, "images": 3}]
    assert needle.select_rows(rows[::2], configs, [200, 300], 4, 0, text_only=False) == rows[::2]
    with pytest.raises(ValueError, match=r"length 200 have \[2, 3\] pictures"):
        needle.select_rows(rows, configs, [200, 300], 4, 0, text_only=False)


def test_cli_refuses_unknown_methods_before_loading_anything(capsys):
    from lookm_jax.cli import main

    assert main(["eval", "needle", "sweep", "--methods", "h2o", "bogus"]) == 2
    assert "unknown methods ['bogus']" in capsys.readouterr().err
    assert main(["eval", "needle", "sweep", "--samples", "4", "--first-sample", "4"]) == 2
    assert "--first-sample must be in [0, --samples - 1] = [0, 3], got 4" in capsys.readouterr().err
    assert main(["eval", "needle", "calibrate", "--methods", "h2o"]) == 2
    assert "calibrate runs the full cache only; --methods and --budgets are for sweep" in capsys.readouterr().err
    assert main(["eval", "needle", "calibrate", "--budgets", "0.2"]) == 2
    assert "--methods and --budgets are for sweep" in capsys.readouterr().err
    assert main(["eval", "needle", "calibrate", "--text-only", "--image-fraction", "0.5"]) == 2
    assert "--text-only has no images" in capsys.readouterr().err


def test_lengths_beyond_the_buckets_are_refused_before_any_haystack_is_built(tmp_path, capsys):
    from lookm_jax.cli import main

    argv = ["eval", "needle", "calibrate", "--jsonl", str(tmp_path / "r.jsonl"), "--output", str(tmp_path / "t.csv")]
    assert main([*argv, "--lengths", "1024", "100000000"]) == 2
    assert "--lengths 100000000: the prompt must fit the largest bucket (16384)" in capsys.readouterr().err
    assert main([*argv, "--lengths", "8170"]) == 2
    assert "with --max-new-tokens 32, the model's context (8192)" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


# ---- the JSONL rows and the command's checks --------------------------------------------------------

ROW = {"seed": 0, "images": 4, "length": 1024, "sample": 0, "label": "full", "method": "full", "text_prior": "",
       "merge": "", "budget": 1.0, "correct": True, "fidelity": 0.5, "depth": 0.25, "prompt_tokens": 1000}
DROP = object()  # a field left out of the row


def _calibrate_report(tmp_path, *extra):
    from lookm_jax.cli import main

    return main(["eval", "needle", "calibrate", "--lengths", "1024", "--samples", "2", "--report-only",
                 "--jsonl", str(tmp_path / "rows.jsonl"), "--output", str(tmp_path / "t.csv"), *extra])


def test_report_of_well_formed_rows_writes_the_summary(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "sample": 1, "budget": 1}) + "\n")
    assert _calibrate_report(tmp_path) == 0
    with open(tmp_path / "t.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["samples"], row["accuracy"], row["fidelity"]) == ("2", "1.0", "0.5")


@pytest.mark.parametrize("change, message", [
    ({"depth": DROP}, r"line 2: not a benchmark row \(a JSON object with label, .*depth\): no depth$"),
    ({"prompt_tokens": DROP}, r"line 2: not a benchmark row \(.*\): no prompt_tokens$"),
    ({"correct": "yes"}, r'line 2: correct "yes" is not true or false$'),
    ({"correct": None}, r"line 2: correct null is not true or false$"),
    ({"fidelity": "x"}, r'line 2: fidelity "x" is not a number in \[0, 1\]$'),
    ({"fidelity": 7.5}, r"line 2: fidelity 7.5 is not a number in \[0, 1\]$"),
    ({"label": ["full"]}, r'line 2: label \["full"\] is not a string$'),
    ({"images": [1]}, r"line 2: images \[1\] is not an integer >= 0$"),
    ({"sample": "0"}, r'line 2: sample "0" is not an integer >= 0$'),
    ({"prompt_tokens": "600"}, r'line 2: prompt_tokens "600" is not an integer >= 1$'),
    ({"budget": "1.0"}, r'line 2: budget "1.0" is not a number in \(0, 1\]$'),
    ({"length": "1024"}, r'line 2: length "1024" is not an integer >= 1$'),
    ({"seed": True}, r"line 2: seed true is not an integer in \[0, 4294967295\]$"),
    ({"merge": "bogus"}, r'line 2: merge "bogus" is not one of "", "none", "averaged", "pivotal", "weighted"$'),
])
def test_a_bad_row_is_refused_in_one_line_naming_its_field(tmp_path, capsys, change, message):
    """Each field of a row is checked against its type and range where the rows are read: the
    error names the file, the line, the field, its value and what it accepts; nothing is written."""
    bad = {k: v for k, v in {**ROW, **change}.items() if v is not DROP}
    text = json.dumps(ROW) + "\n" + json.dumps(bad) + "\n"
    (tmp_path / "rows.jsonl").write_text(text)
    assert _calibrate_report(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"lookm: error: {tmp_path / 'rows.jsonl'}, line 2: ")
    assert re.search(message, err), err
    assert os.listdir(tmp_path) == ["rows.jsonl"] and (tmp_path / "rows.jsonl").read_text() == text


def test_a_rerun_reads_the_rows_as_the_report_does_before_it_runs(tmp_path):
    """The resume reads the same schema: a bad row refuses the run before anything (the cut last
    line included) is touched."""
    path = tmp_path / "rows.jsonl"
    text = json.dumps(ROW) + "\n" + json.dumps({**ROW, "sample": 1, "fidelity": 7.5}) + "\n" + '{"seed": 0, "ima'
    path.write_text(text)
    with pytest.raises(InputError, match=r"line 2: fidelity 7.5 is not a number in \[0, 1\]"):
        harness.run_prompts(None, [harness.SweepConfig("full", 1.0)], [], str(path), needle.KEY_FIELDS,
                            needle.is_correct, schema=needle.ROW_SCHEMA, max_new_tokens=4)
    assert path.read_text() == text


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--report-only", "--jsonl", "{tmp}/nothere.jsonl"],
     r"--jsonl \S*nothere.jsonl does not exist \(--report-only summarises the rows of an earlier run\)"),
    (["calibrate", "--lengths", "1024", "1280", "1024"], r"--lengths repeats 1024: give each value once"),
    (["sweep", "--budgets", "0.1", "0.2", "0.10"], r"--budgets repeats 0.1: give each value once"),
    (["calibrate", "--output", "{tmp}/nowhere/t.csv"], r"--output \S*t.csv: folder \S*nowhere does not exist"),
    (["calibrate", "--output", "{tmp}"], r"--output \S* is a folder; give a file path"),
    (["calibrate", "--jsonl", "{tmp}"], r"--jsonl \S* is a folder; give a file path"),
])
def test_arguments_that_cannot_run_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    from lookm_jax.cli import main

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    defaults = {"--jsonl": str(tmp_path / "r.jsonl"), "--output": str(tmp_path / "t.csv")}
    assert main(["eval", "needle", *argv, *[x for flag, path in defaults.items() if flag not in argv
                                            for x in (flag, path)]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not os.listdir(tmp_path)

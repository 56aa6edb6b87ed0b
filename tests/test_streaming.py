"""Loading and converting hold one tensor at a time on the host; converted folders keep the
checkpoint's dtype; bench/load_memory.py's core on a small checkpoint."""

from __future__ import annotations

import os
import sys
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest

import lookm_jax
from lookm_jax import cli
from lookm_jax.convert import runtime, safetensors_io, store, tables
from lookm_jax.convert.tables import CheckpointError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import load_memory  # noqa: E402  (bench/ is not a package)

# Largest tensors: embed and lm_head [16384, 512] fp16 = 16 MiB; 6 decoder layers of 6.8 MiB; a small tower.
DIMS = load_memory.Dims(hidden=512, heads=8, intermediate=1536, vocab=16384, layers=6, vision_hidden=128,
                        vision_heads=4, vision_intermediate=256, vision_layers=2, image_size=56, patch=14)
SLACK = 2 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("fp16_llava")
    load_memory.build_checkpoint(str(folder), DIMS)
    return str(folder)


def host_peak(fn) -> int:
    """Peak bytes of the host allocations (numpy's included) made while `fn` runs; device buffers
    are XLA's own and not counted."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_load_and_convert_hold_about_one_tensor_on_the_host(checkpoint, tmp_path, monkeypatch):
    """Checkpoint 73 MiB, largest tensor 16 MiB. Each tensor is read through a map of its bytes (not
    an allocation), and each parameter is built in a host buffer of its own pages
    (`tables.aligned_empty`) that XLA:CPU adopts as the device array: so loading maps the params'
    bytes and allocates nothing else of size (a second copy of any tensor would show; a whole copy of
    the model doubles it). Converting allocates one 4 MiB block at a time (the transposed lm_head made
    contiguous). SLACK: the Python objects, modules and the finite check's blocks that a call
    allocates (~1 MiB)."""
    buffers = []  # (address, bytes) of each parameter's host buffer
    build = tables.aligned_empty

    def recorded(shape, dtype):
        array = build(shape, dtype)
        buffers.append((array.ctypes.data, array.nbytes))
        return array

    monkeypatch.setattr(tables, "aligned_empty", recorded)
    monkeypatch.setattr(runtime, "aligned_empty", recorded)
    largest = load_memory.largest_tensor_bytes(checkpoint)
    assert largest == 16 << 20 and load_memory.folder_bytes(checkpoint) > 4 * largest
    tensors = safetensors_io.read_header(os.path.join(checkpoint, "model.safetensors"))
    unused = sum(t.nbytes for name, t in tensors.items() if "post_layernorm" in name)
    params_bytes = sum(t.nbytes for t in tensors.values()) - unused  # bf16 from fp16: as many bytes
    for folder in (checkpoint, None):
        if folder is None:
            convert_peak = host_peak(lambda: cli.main(["convert", checkpoint, str(tmp_path / "c")]))
            assert convert_peak <= (4 << 20) + SLACK, convert_peak
            folder = str(tmp_path / "c")
        model, buffers[:] = [], []
        load_peak = host_peak(lambda: model.append(lookm_jax.load(folder, dtype=jax.numpy.bfloat16)))
        leaves = jax.tree.leaves(model[0].params)
        assert sum(a.nbytes for a in leaves) == sum(n for _, n in buffers) == params_bytes
        assert load_peak <= SLACK, (folder, load_peak)
        if jax.default_backend() == "cpu":  # the host buffers became the device arrays
            assert sorted(a.unsafe_buffer_pointer() for a in leaves) == sorted(address for address, _ in buffers)


def test_converted_folders_keep_the_checkpoints_dtype_unless_asked(checkpoint, tmp_path):
    """fp16 stays fp16 (the folder within 1% of the checkpoint's bytes) and loads to the same params
    as the checkpoint; --dtype float32 stores fp32."""
    assert cli.main(["convert", checkpoint, str(tmp_path / "fp16")]) == 0
    assert cli.main(["convert", checkpoint, str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    source = load_memory.folder_bytes(checkpoint)
    for name, dtype, ratio in (("fp16", np.float16, 1.0), ("fp32", np.float32, 2.0)):
        header = safetensors_io.read_header(str(tmp_path / name / store.PARAMS))
        assert {t.dtype for t in header.values()} == {np.dtype(dtype)}, name
        assert abs(sum(t.nbytes for t in header.values()) / source - ratio) < 0.01 * ratio, name
    assert os.path.getsize(tmp_path / "fp16" / store.PARAMS) <= 1.01 * source
    for name in ("fp16", "fp32"):
        a, b = (lookm_jax.load(path, dtype=jax.numpy.bfloat16).params for path in (checkpoint, str(tmp_path / name)))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_truncated_or_garbled_header_is_one_checkpoint_error(checkpoint, tmp_path):
    data = open(os.path.join(checkpoint, "model.safetensors"), "rb").read()
    for name, content, why in (("short", data[:4], "header of"), ("cut", data[: len(data) // 2], "do not fit"),
                               ("json", data[:8] + b"{" * 64 + data[72:], "Expecting")):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match=rf"^{path}: corrupt or unreadable safetensors shard \(.*{why}"):
            safetensors_io.read_header(str(path))


def test_bench_core_measures_a_tiny_checkpoint(tmp_path):
    """bench/load_memory.py's steps in fresh processes: peaks and times read back, the checks computed."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    dims = load_memory.Dims(hidden=64, heads=4, intermediate=96, vocab=256, layers=1, vision_hidden=32,
                            vision_heads=2, vision_intermediate=48, vision_layers=1, image_size=28, patch=14)
    load_memory.build_checkpoint(str(folder), dims)
    report = load_memory.run(str(folder), steps=("baseline", "convert"))
    steps = report["steps"]
    assert steps["baseline"]["peak_rss_bytes"] > 50 << 20  # python + jax: tens of MiB at least
    assert steps["convert"]["seconds"] > 0 and steps["convert"]["peak_rss_bytes"] > steps["baseline"]["peak_rss_bytes"] / 2
    assert set(report["checks"]) == {"convert peak <= 1.3 x largest tensor + baseline",
                                     "converted folder within 5% of the checkpoint"}
    assert report["checks"]["converted folder within 5% of the checkpoint"]


def test_load_refuses_a_mesh_that_is_not_one(checkpoint):
    with pytest.raises(lookm_jax.InputError, match=r"^mesh must be a jax.sharding.Mesh \(lookm_jax.make_mesh\) or None, "
                                                    r"got str$"):
        lookm_jax.load(checkpoint, mesh="2x2")

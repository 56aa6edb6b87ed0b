"""Loader fuzzing: seeded mutations of config.json fields, safetensors headers and GGUF headers, for
every architecture the loader reads. Each mutated checkpoint either loads or raises the project's own
error (`InputError`, `ConfigError`, `CheckpointError`) with a one-line message; never another
exception, a hang (each case runs under an alarm), or a half-written converted folder (`lookm
convert` leaves a complete folder or none)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import struct

import pytest

import lookm_jax
from lookm_jax.cli import main as lookm_main
from lookm_jax.convert import store
from lookm_jax.convert.tables import CheckpointError
from lookm_jax.errors import InputError
from lookm_jax.models.config import ConfigError

PROJECT_ERRORS = (InputError, ConfigError, CheckpointError)
CASES = 200  # mutations per (architecture, kind); each loads in milliseconds
CASE_SECONDS = 20  # a case that takes longer is a hang
VALUES = [None, -1, 0, 1, 3, 2**31, 10**12, -10**12, 0.5, float("nan"), "", "x", "llama", [], [1, 2], {}, True, False]


def _tiny_llava(folder):
    from conftest import tiny_llava

    tiny_llava(folder)


def _tiny_qwen2_vl(folder):
    from tests.test_qwen2_vl import tiny_qwen2_vl

    tiny_qwen2_vl(folder)


def _tiny_qwen2_5_vl(folder):
    from tests.test_qwen2_5_vl import tiny_qwen2_5_vl

    tiny_qwen2_5_vl(folder)


def _tiny_llava_next(folder):
    from tests.test_llava_next import tiny_llava_next

    tiny_llava_next(folder)


def _tiny_llava_onevision(folder):
    from tests.test_llava_onevision import tiny_onevision

    tiny_onevision(folder)


def _tiny_internvl(folder):
    from tests.test_internvl import tiny_internvl

    tiny_internvl(folder)


def _tiny_mobilevlm(folder):
    """MobileVLM-v2 in the original layout (its config names a CLIP tower folder beside it)."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from tests.original_layout import prefixed, save_checkpoint, tiny_llama, widen
    from tests.test_mobilevlm import GRID, LDPv2, _config

    lm, text = tiny_llama(seed=1)
    tower_cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=1, num_attention_heads=4,
                                 image_size=GRID * 6, patch_size=6)
    tower = CLIPVisionModel(tower_cfg).eval()
    widen(tower)
    tower_cfg.save_pretrained(os.path.join(folder, "clip_tower"))
    tensors = {**lm.state_dict(), **prefixed("model.vision_tower.vision_tower.", tower.state_dict()),
               **prefixed("model.mm_projector.", LDPv2(32, 48, GRID // 2).eval().state_dict())}
    save_checkpoint(os.path.join(folder, "ckpt"), tensors, _config(os.path.join(folder, "clip_tower"), text))
    torch.manual_seed(0)


def _tiny_gguf(folder):
    from tests.test_gguf import _write_tiny

    _write_tiny(os.path.join(folder, "tiny.gguf"))


BUILDERS = {"llava": _tiny_llava, "qwen2_vl": _tiny_qwen2_vl, "qwen2_5_vl": _tiny_qwen2_5_vl,
            "llava_next": _tiny_llava_next, "llava_onevision": _tiny_llava_onevision, "internvl": _tiny_internvl, "mobilevlm": _tiny_mobilevlm}
CHECKPOINT = {"mobilevlm": "ckpt"}  # the checkpoint's subfolder, where it is not the builder's folder


@contextlib.contextmanager
def alarm(seconds: int, what: str):
    def hang(signum, frame):
        raise TimeoutError(f"{what} took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_case(path: str, out: str, what: str) -> str:
    """Load `path` and convert it to `out`: each succeeds or raises one of the project's errors with a
    one-line message, and `out` is afterwards either absent or a complete converted folder. -> "ok" or
    the error's class name."""
    outcome = "ok"
    with alarm(CASE_SECONDS, what):
        try:
            lookm_jax.load(path)
        except PROJECT_ERRORS as e:
            message = str(e)
            assert message and "\n" not in message, f"{what}: {type(e).__name__} message {message!r}"
            outcome = type(e).__name__
        except Exception as e:  # anything else is a finding
            raise AssertionError(f"{what}: load raised {type(e).__name__}: {e}") from e
        code = lookm_main(["convert", path, out])
    assert code in (0, 2), f"{what}: lookm convert exited {code}"
    if code == 0:
        assert store.is_converted(out), f"{what}: convert said done, {out} is not a converted folder"
        lookm_jax.load(out)
        shutil.rmtree(out)
    else:
        assert not os.path.exists(out), f"{what}: a failed convert left {out}"
    return outcome


def _paths(tree, prefix=()):
    """Every key path of a JSON tree (dict keys and list indices), parents before children."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from _paths(value, prefix + (key,))


def mutate_config(config: dict, rng: random.Random) -> tuple[dict, str]:
    config = json.loads(json.dumps(config))
    path = rng.choice(list(_paths(config)))
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.25:
        del parent[path[-1]]
        return config, f"config {'.'.join(map(str, path))} deleted"
    value = rng.choice(VALUES)
    parent[path[-1]] = value
    return config, f"config {'.'.join(map(str, path))} = {value!r}"


def mutate_safetensors(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A safetensors file: 8-byte little-endian header length, the JSON header, the tensors' bytes."""
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    kind = rng.randrange(6)
    if kind == 0:  # the header length
        value = rng.choice([0, 1, size - 1, size + 1, len(data), 2**40, 2**64 - 1])
        return struct.pack("<Q", value) + data[8:], f"header length {value}"
    if kind == 1:  # bytes of the JSON header
        raw = bytearray(data[8:8 + size])
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return data[:8] + bytes(raw) + body, "header bytes flipped"
    if kind == 2:  # the file cut short
        cut = rng.randrange(len(data))
        return data[:cut], f"truncated at {cut} of {len(data)} bytes"
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    if kind == 3:
        entry["dtype"] = rng.choice(["F64", "I8", "BOOL", "F8_E4M3", "X", 3, None])
        what = f"{name} dtype {entry['dtype']!r}"
    elif kind == 4:
        shape = list(entry["shape"])
        entry["shape"] = rng.choice([shape + [1], shape[:-1], [-1] + shape[1:], [2**40] + shape[1:], "x", [0]])
        what = f"{name} shape {entry['shape']!r}"
    else:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[end, start], [start, len(body) + 8], [-8, end], [start], "x",
                                            [start + 1, end + 1], [0, 2**62]])
        what = f"{name} data_offsets {entry['data_offsets']!r}"
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body, what


def mutate_gguf(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A GGUF file: magic, version, tensor count, key-value count, the key-values, tensor infos, data."""
    kind = rng.randrange(4)
    raw = bytearray(data)
    if kind == 0:  # one of the fixed header fields
        offset, width = rng.choice([(0, 4), (4, 4), (8, 8), (16, 8)])
        value = rng.choice([0, 1, 3, 2**31, 2**63 - 1, 2**64 - 1]) % 2 ** (8 * width)
        raw[offset:offset + width] = value.to_bytes(width, "little")
        return bytes(raw), f"header bytes [{offset}, {offset + width}) = {value}"
    if kind == 1:  # bytes of the key-values and tensor infos
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(24, min(len(raw), 4096))] = rng.randrange(256)
        return bytes(raw), "metadata bytes flipped"
    cut = rng.randrange(len(data))
    return data[:cut], f"truncated at {cut} of {len(data)} bytes"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    built = {}
    for name, build in BUILDERS.items():
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        built[name] = os.path.join(folder, CHECKPOINT.get(name, ""))
    folder = tmp_path_factory.mktemp("gguf")
    _tiny_gguf(folder)
    built["gguf"] = os.path.join(folder, "tiny.gguf")
    return built


def _outcomes(tmp_path, source: str, cases, mutate) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i, rng in enumerate(cases):
        case = tmp_path / f"case{i}"
        if os.path.isdir(source):
            shutil.copytree(source, case)
            what = mutate(str(case), rng)
            path = str(case)
        else:
            case.mkdir()
            path = str(case / os.path.basename(source))
            shutil.copy(source, path)
            what = mutate(path, rng)
        outcome = check_case(path, str(tmp_path / f"out{i}"), f"case {i} ({what})")
        counts[outcome] = counts.get(outcome, 0) + 1
        shutil.rmtree(case)
    return counts


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_mutated_configs_load_or_are_refused(sources, tmp_path, arch):
    def mutate(folder, rng):
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config, what = mutate_config(json.load(f), rng)
        with open(path, "w") as f:
            json.dump(config, f)
        return what

    counts = _outcomes(tmp_path, sources[arch], (random.Random(f"{arch}-config-{i}") for i in range(CASES)), mutate)
    assert counts.get("ok", 0) > 0 and sum(v for k, v in counts.items() if k != "ok") > CASES // 4, counts


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_mutated_safetensors_headers_load_or_are_refused(sources, tmp_path, arch):
    def mutate(folder, rng):
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        path = os.path.join(folder, rng.choice(files))
        with open(path, "rb") as f:
            data, what = mutate_safetensors(f.read(), rng)
        with open(path, "wb") as f:
            f.write(data)
        return f"{os.path.basename(path)}: {what}"

    counts = _outcomes(tmp_path, sources[arch], (random.Random(f"{arch}-st-{i}") for i in range(CASES)), mutate)
    assert sum(v for k, v in counts.items() if k != "ok") > CASES // 2, counts


def test_mutated_gguf_headers_load_or_are_refused(sources, tmp_path):
    def mutate(path, rng):
        with open(path, "rb") as f:
            data, what = mutate_gguf(f.read(), rng)
        with open(path, "wb") as f:
            f.write(data)
        return what

    counts = _outcomes(tmp_path, sources["gguf"], (random.Random(f"gguf-{i}") for i in range(3 * CASES)), mutate)
    assert sum(v for k, v in counts.items() if k != "ok") > CASES, counts

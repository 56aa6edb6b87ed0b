"""What every training run here shares: the jitted optimizer step, atomic checkpoints with the
optimizer state and the settings that shape the run, their refusal on a changed resume, and the log
truncated to the checkpoint.

A run's config is a frozen dataclass; the fields named in its class attribute `FREE_ON_RESUME`
(evaluation and checkpoint cadence) may change on resume, every other one must not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from typing import Callable

import flax.serialization
import jax
import jax.numpy as jnp
import optax

CHECKPOINT = "checkpoint.msgpack"
LOG = "log.jsonl"


def jit_step(objective: Callable, tx: optax.GradientTransformation) -> Callable:
    """(trainable, opt_state, frozen, batch) -> (trainable, opt_state, loss, metrics), jitted, the
    trainable parameters and optimizer state donated. `objective(trainable, frozen, batch)` returns
    (the total minimised, (the loss to report, metrics)); static through the closure."""
    def step(trainable, opt_state, frozen, batch):
        (_, (loss, metrics)), grads = jax.value_and_grad(objective, has_aux=True)(trainable, frozen, batch)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def end_step(log, bar, record: dict, config, last: int, start: float, evaluate: Callable[[], dict] | None,
             save: Callable[[], None]) -> None:
    """What each step of a run ends with: the held-out `evaluate()` every `config.eval_every` steps and at
    the run's last (printed, into `record`), `save()` every `config.checkpoint_every` steps and at this
    call's `last`, and `record` with its elapsed seconds since `start` appended to `log`."""
    step = record["step"]
    if evaluate is not None and (step % config.eval_every == 0 or step == config.steps):
        record.update(evaluate())
        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in record.items() if k != "step"))
    if step % config.checkpoint_every == 0 or step == last:
        save()
    record["seconds"] = round(time.perf_counter() - start, 2)
    log.write(json.dumps(record) + "\n")
    log.flush()


def arrays_of(batch) -> dict:
    """A batch dataclass of numpy arrays -> {field: device array} (fields that are None left out)."""
    return {f.name: jnp.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)
            if getattr(batch, f.name) is not None}


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def settings_of(config) -> dict:
    """The config fields a checkpoint must be resumed with, as JSON values."""
    settings = json.loads(json.dumps(dataclasses.asdict(config)))
    free = getattr(type(config), "FREE_ON_RESUME", ())
    return {k: v for k, v in settings.items() if k not in free}


def save_checkpoint(directory: str, step: int, trainable: dict, opt_state, config) -> None:
    state = {"step": step, "trainable": jax.device_get(trainable), "opt_state": jax.device_get(opt_state),
             "settings": json.dumps(settings_of(config))}
    write_atomic(os.path.join(directory, CHECKPOINT), flax.serialization.to_bytes(state))


def load_checkpoint(directory: str, trainable: dict, opt_state, config) -> tuple[int, dict, object] | None:
    """(step, trainable, opt_state) from `directory`, shaped like the given templates; None if absent.
    Refuses (ValueError) a checkpoint that cannot be read or was written with other settings."""
    path = os.path.join(directory, CHECKPOINT)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    try:
        state = flax.serialization.msgpack_restore(data)
        saved = json.loads(state.pop("settings", "{}"))  # a checkpoint from before settings were saved: {}
        if not isinstance(saved, dict):
            raise TypeError(f"settings {saved!r}")
    except Exception as err:  # msgpack's errors share no base class beyond Exception
        raise ValueError(f"{path}: not a readable checkpoint ({err}); delete it or give another --output") from None
    settings = settings_of(config)
    changed = "; ".join(f"{k}: {saved[k]} -> {v}" for k, v in settings.items() if k in saved and saved[k] != v)
    if changed:
        raise ValueError(f"{path} was written with other settings ({changed}); resume with the same flags or "
                         "give another --output")
    template = {"step": 0, "trainable": trainable, "opt_state": opt_state}
    try:
        state = flax.serialization.from_state_dict(template, state)
    except (ValueError, KeyError) as err:
        raise ValueError(f"{path}: does not match this run's parameters ({err}); resume with the same flags "
                         "or give another --output") from None
    return int(state["step"]), jax.device_put(state["trainable"]), jax.device_put(state["opt_state"])


def truncate_log(path: str, step: int) -> None:
    """Drop log records past the checkpoint (a killed run logged steps it will now redo)."""
    if os.path.exists(path):
        with open(path) as f:
            lines = [line for line in f if line.strip() and _complete_step(line) <= step]
        write_atomic(path, "".join(lines).encode())


def _complete_step(line: str) -> float:
    """A record's step (0 for stage 0's records); inf for a line cut short by the kill."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")

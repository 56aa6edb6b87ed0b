"""LLaVA stage-1 alignment in JAX: train a CLIP tower and the projector against a frozen decoder.

The decoder's parameters (`params["text"]`) never change; the tower (`params["vision"]`) and the
projector (`params["projector"]`) learn from next-token loss on the answer tokens alone. Nothing
but pixels reaches the image features.

Data for step s is a pure function of (seed, s) (`lookm_jax.train.data`), and a checkpoint holds
the step, the trainable parameters and the optimizer state, written atomically. So a run killed
after a checkpoint and resumed computes the same parameters as one that was never stopped.

Where the tower trains too, stage 0's patch loss can stay on as an anchor (`TrainConfig.anchor_weight`):
each step adds it on a batch of labelled scenes, through a linear head that is trained alongside
(`params["head"]`, never exported).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lookm_jax.checks import is_real
from lookm_jax.models import llama, llava
from lookm_jax.train.data import Batch, BatchSpec, Encoder, single_picture_spec
from lookm_jax.train import tower
from lookm_jax.train.runs import CHECKPOINT, LOG, arrays_of, end_step, jit_step, load_checkpoint, save_checkpoint, truncate_log, write_atomic

# Records written to LOG before stage 1's first step, each keyed by one of these: stage 0's steps
# (`tower.pretrain`) and the anchor head's fit on a starting tower (`tower.fit_head`).
PRELUDE_KEYS = ("pretrain_step", "anchor_head_fit")
TRAINABLE = ("vision", "projector")  # what a run exports; the anchor's head trains beside them


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1200
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.05
    clip_norm: float = 1.0
    seed: int = 0
    single: BatchSpec = single_picture_spec(batch_size=8, turns=3)
    multi: BatchSpec | None = BatchSpec(batch_size=2, pictures=8, turns=3, length=672, max_targets=16, min_pictures=2)
    multi_every: int = 4  # every multi_every-th step (1-based) uses the multi-picture batch
    eval_every: int = 50
    checkpoint_every: int = 25
    eval_samples: int = 32  # held-out single-picture questions (and as many held-out-combination ones)
    # Weight of the penalty on image-token norms: mean (log(|x| / mean |text embedding|))^2. Without it
    # the projector's outputs grew to ~100x the text embeddings' norm (308 vs 2.8), where the frozen
    # decoder's residual updates cannot move them and the gradient to the tower vanished.
    image_norm_weight: float = 0.1
    # The tower's learning rate as a fraction of the projector's. 0 (LLaVA's stage 1) keeps stage 0's
    # features: the step then computes no gradient through the tower. Trained at the full rate, the
    # stage-0 tower's features no longer carried shape (linear probe on object patches 0.38, chance 0.33).
    tower_learning_rate_scale: float = 0.0
    # Weight of stage 0's patch loss (`tower.patch_loss`) kept in the objective while the tower trains
    # (0 = none): without an anchor, the tower trained through the decoder lost shape (sessions 6, 10).
    anchor_weight: float = 0.0
    anchor_batch_size: int = 16  # labelled scenes per step, drawn from anchor_scenes of stage 0's stream
    anchor_scenes: int = 4096
    pretrain: tower.PretrainConfig | None = tower.PretrainConfig()  # stage 0 (tower alone), run before step 1
    FREE_ON_RESUME: ClassVar[tuple[str, ...]] = ("eval_every", "checkpoint_every", "eval_samples")

    def __post_init__(self):
        for name in ("steps", "eval_every", "checkpoint_every", "eval_samples", "multi_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tower_learning_rate_scale <= 1:
            raise ValueError(f"tower_learning_rate_scale must be in [0, 1], got {self.tower_learning_rate_scale}")
        if self.anchor_weight < 0 or (self.anchor_weight > 0 and self.tower_learning_rate_scale == 0):
            raise ValueError(f"anchor_weight must be >= 0, and > 0 only while the tower trains "
                             f"(tower_learning_rate_scale > 0), got {self.anchor_weight}, {self.tower_learning_rate_scale}")
        if not 1 <= self.anchor_batch_size <= self.anchor_scenes:
            raise ValueError(f"need 1 <= anchor_batch_size <= anchor_scenes, got {self.anchor_batch_size}, "
                             f"{self.anchor_scenes}")
        for name in ("learning_rate", "anchor_weight"):
            if not is_real(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not self.learning_rate > 0 or self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise ValueError(f"need learning_rate > 0 and 0 <= warmup_steps < steps, got "
                             f"{self.learning_rate}, {self.warmup_steps}, {self.steps}")

    def spec(self, step: int) -> BatchSpec:
        """The batch kind of (1-based) step `step`."""
        return self.multi if self.multi is not None and step % self.multi_every == 0 else self.single


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm clipping; the tower at
    `tower_learning_rate_scale` of the rate (nothing when 0), the projector and the anchor's head at
    the full rate."""
    def adamw(scale: float) -> optax.GradientTransformation:
        peak = scale * config.learning_rate
        schedule = optax.warmup_cosine_decay_schedule(0.0, peak, config.warmup_steps, config.steps,
                                                      end_value=peak * 0.02)
        return optax.adamw(schedule, weight_decay=config.weight_decay)

    scale = config.tower_learning_rate_scale
    tower_tx = adamw(scale) if scale > 0 else optax.set_to_zero()
    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.multi_transform({"tower": tower_tx, "projector": adamw(1.0)},
                                             lambda params: {k: "tower" if k == "vision" else "projector"
                                                             for k in params}))


def answer_metrics(cfg, trainable: dict, text_params: dict, batch: dict) -> tuple[jax.Array, dict]:
    """Mean cross-entropy over the answer tokens, and {"accuracy": of each answer's first token (its
    word), "image_norm": penalty term of the image tokens' norms (`TrainConfig.image_norm_weight`)}."""
    params = {"text": text_params, **trainable}
    x, is_image = llava.embed(cfg, params, batch["ids"], batch["pixel_values"])
    return embedded_answer_metrics(cfg.text, text_params, x, is_image, batch)


def embedded_answer_metrics(text_cfg, text_params: dict, x: jax.Array, is_image: jax.Array,
                            batch: dict, forward: Callable | None = None) -> tuple[jax.Array, dict]:
    """`answer_metrics` of prompts already embedded: x [B, L, H] with the image tokens in place.
    `forward(x, valid) -> final-normed h` replaces the frozen decoder's pass when given (a probe's
    decoder with extra weights, bench/oracle_tokens.py)."""
    text_norm = jnp.linalg.norm(text_params["embed"].astype(jnp.float32), axis=-1).mean()
    log_ratio = jnp.log(jnp.linalg.norm(x.astype(jnp.float32), axis=-1) / text_norm)  # [B, L]
    image_norm = jnp.where(is_image, log_ratio**2, 0.0).sum() / jnp.maximum(is_image.sum(), 1)
    h = (forward or functools.partial(llama.forward, text_cfg, text_params))(x, batch["valid"])  # [B, L, H]
    h = jnp.take_along_axis(h, batch["target_positions"][..., None], axis=1)  # [B, A, H]
    logits = llama.lm_logits(text_params, h)  # [B, A, V] fp32: the head runs on answer slots only
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)[..., 0]
    mask = batch["target_mask"].astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
    first = batch["answer_start"].astype(jnp.float32)
    accuracy = (correct * first).sum() / jnp.maximum(first.sum(), 1.0)
    return (nll * mask).sum() / count, {"accuracy": accuracy, "image_norm": image_norm}


def make_step(cfg, tx: optax.GradientTransformation, image_norm_weight: float = 0.0,
              train_tower: bool = True, anchor_weight: float = 0.0) -> Callable:
    """(trainable, opt_state, text_params, batch) -> (trainable, opt_state, answer loss, metrics).

    Minimises the answer loss + image_norm_weight x the image-norm penalty (`answer_metrics`) +
    anchor_weight x stage 0's patch loss on batch["anchor"] (labelled scenes; metric "anchor_loss");
    with `train_tower` False no gradient flows into the tower. Jitted; the trainable parameters and
    optimizer state are donated. Static through the closure: the model config, the optimizer, the
    weights and `train_tower`. Each batch kind (its shapes) compiles once.
    """
    def objective(trainable, text_params, batch):
        if not train_tower:
            trainable = {**trainable, "vision": jax.lax.stop_gradient(trainable["vision"])}
        loss, metrics = answer_metrics(cfg, trainable, text_params, batch)
        total = loss + image_norm_weight * metrics["image_norm"]
        if anchor_weight:
            anchor, _ = tower.patch_loss(cfg.vision, trainable["vision"], trainable["head"], batch["anchor"])
            metrics = {**metrics, "anchor_loss": anchor}
            total += anchor_weight * anchor
        return total, (loss, metrics)

    return jit_step(objective, tx)


class HeldOut:
    """Teacher-forced answer-token accuracy on fixed held-out batches (single pictures, and the
    held-out colour-shape combination)."""

    def __init__(self, encoder: Encoder, config: TrainConfig, image_size: int, batch_size: int = 16):
        spec = single_picture_spec(batch_size, turns=1)
        count = -(-config.eval_samples // batch_size)
        self.batches = {split: [arrays_of(spec.make(encoder, split, config.seed, i * batch_size, image_size))
                                for i in range(count)] for split in ("heldout", "combination")}

    def __call__(self, metrics: Callable, trainable: dict, text_params: dict) -> dict[str, float]:
        out = {}
        for split, batches in self.batches.items():
            accuracy = [float(metrics(trainable, text_params, b)[1]["accuracy"]) for b in batches]
            out[f"{split}_accuracy"] = float(np.mean(accuracy))
        return out


def train(model, config: TrainConfig, output: str, *, trainable: dict | None = None,
          batch_fn: Callable[[int], Batch] | None = None, stop_after: int | None = None,
          progress: bool = True) -> dict:
    """Train `model`'s tower and projector (from `trainable`, default: the model's own) into `output`.

    Resumes from `output`'s checkpoint when there is one. `batch_fn(step)` overrides the scene
    batches (tests use a fixed batch); `stop_after` ends the run after that many steps of this call
    (as a kill would, after the last checkpoint). Returns the final trainable parameters (with the
    anchor's "head" when `config.anchor_weight` > 0: stage 0's, or fitted on the starting tower).
    """
    from tqdm import tqdm

    os.makedirs(output, exist_ok=True)
    cfg = model.config
    text_params = model.params["text"]
    trainable = trainable if trainable is not None else {k: model.params[k] for k in TRAINABLE}
    anchored = config.anchor_weight > 0
    if anchored:  # the head's shape, for the optimizer and the checkpoint; its values come below
        trainable = {**trainable, "head": tower.init_head(cfg.vision, config.seed)}
    trainable = jax.tree.map(jnp.array, trainable)  # own copies: the step donates them
    tx = optimizer(config)
    opt_state = tx.init(trainable)
    step = 0
    restored = load_checkpoint(output, trainable, opt_state, config)
    image_size = cfg.pixel_shape[-1]
    encoder = Encoder.of(model) if batch_fn is None else None

    def preprocess(pictures) -> np.ndarray:  # PIL images -> pixel_values, the model's own processor
        return model.processor.preprocess(list(pictures))[0]

    anchor_data = tower.labelled_scenes(cfg.vision, preprocess, "train", config.seed, tower.TRAIN_FIRST_INDEX,
                                        config.anchor_scenes) if anchored else None
    if restored is not None:
        step, trainable, opt_state = restored
        truncate_log(os.path.join(output, LOG), step)
    else:
        records = []
        if config.pretrain is not None and batch_fn is None:
            vision_tower, head, records = tower.pretrain(cfg.vision, trainable["vision"], preprocess,
                                                         config.pretrain, progress=progress)
            trainable = {**trainable, "vision": vision_tower} | ({"head": head} if anchored else {})
        elif anchored:
            head, accuracy = tower.fit_head(cfg.vision, trainable["vision"], anchor_data, config.seed)
            trainable = {**trainable, "head": head}
            records = [{"anchor_head_fit": accuracy}]
        if records:
            trainable = jax.device_put(trainable)
            with open(os.path.join(output, LOG), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            save_checkpoint(output, 0, trainable, opt_state, config)
    if batch_fn is None:
        def batch_fn(s: int) -> Batch:
            spec = config.spec(s)
            return spec.make(encoder, "train", config.seed, (s - 1) * spec.batch_size, image_size)
    train_step = make_step(cfg, tx, config.image_norm_weight, config.tower_learning_rate_scale > 0,
                           config.anchor_weight)
    metrics = jax.jit(lambda t, p, b: answer_metrics(cfg, t, p, b))
    held_out = HeldOut(encoder, config, image_size) if encoder is not None else None
    last = config.steps if stop_after is None else min(config.steps, step + stop_after)
    bar = tqdm(total=config.steps, initial=step, desc="train vision", unit="step", disable=not progress)
    log = open(os.path.join(output, LOG), "a")
    start, tokens = time.perf_counter(), 0
    while step < last:
        step += 1
        batch = batch_fn(step)
        arrays = arrays_of(batch)
        if anchored:  # seeded by the step, as the scene batches are: a resumed run draws the same
            rng = np.random.default_rng([config.seed, step])
            arrays["anchor"] = tower.sample_batch(anchor_data, config.anchor_batch_size, rng)
        trainable, opt_state, loss, step_metrics = train_step(trainable, opt_state, text_params, arrays)
        loss = float(loss)
        tower.check_finite("stage-1", loss, step, config.learning_rate)
        tokens += int(batch.valid.sum())
        record = {"step": step, "loss": loss,
                  **{k: float(v) for k, v in step_metrics.items()},
                  "pictures": int(batch.pixel_values.shape[0] // batch.ids.shape[0])}
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.2f}",
                        tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        end_step(log, bar, record, config, last, start,
                 None if held_out is None else lambda: held_out(metrics, trainable, text_params),
                 lambda: save_checkpoint(output, step, trainable, opt_state, config))
    bar.close()
    log.close()
    return jax.device_get(trainable)


def export_weights(path: str, trainable: dict, metadata: dict[str, str]) -> None:
    """The trained tower + projector as one safetensors file (flat "vision.*", "projector.*" names;
    an anchor's head stays out), written atomically; `lookm_jax.loading.read_demo_vision` reads it back."""
    from safetensors.numpy import save

    from lookm_jax.convert import store

    exported = {k: trainable[k] for k in TRAINABLE}
    flat = {k: np.ascontiguousarray(v, np.float32) for k, v in store.flatten(jax.device_get(exported)).items()}
    write_atomic(path, save(flat, metadata=metadata))

"""Stage 0: pretrain the CLIP tower alone on dense patch labels of the scenes, before alignment.

A LLaVA tower comes pretrained (CLIP); ours starts from scratch, and every step through the frozen
decoder costs ~10 s on 2 CPU cores. So the tower first learns, without the decoder, what each patch
shows: a linear head on every patch feature predicts the colour and the shape of the object covering
the patch (or background). This is cheap (the tower is ~2 M parameters) and makes the features
linearly readable; stage 1 (`lookm_jax.train.vision`) then aligns them to the decoder on answer
tokens. The head is discarded: at inference only pixels reach the features.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from PIL import Image, ImageDraw

from lookm_jax import scenes
from lookm_jax.models import clip


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    steps: int = 400
    batch_size: int = 32
    dataset: int = 2048  # distinct training scenes, cycled
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    seed: int = 0


def patch_labels(scene: scenes.Scene, size: int, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (colour, shape) [P] int32 per patch, row-major: the class covering most of the patch
    (0 = background, else 1 + index in COLOURS / SHAPES), drawn with the same geometry as `render`."""
    big = 2 * size
    ids = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(ids)
    for i, o in enumerate(scene.objects, start=1):
        scenes.draw_object(draw, o, big, i)
    grid = np.asarray(ids).reshape(size // patch, 2 * patch, size // patch, 2 * patch).transpose(0, 2, 1, 3)
    grid = grid.reshape(-1, (2 * patch) ** 2)
    counts = np.stack([(grid == i).sum(-1) for i in range(len(scene.objects) + 1)], axis=-1)
    owner = counts.argmax(-1)  # [P]: 0 = background, i = object i
    colour_of = np.array([0] + [1 + list(scenes.COLOURS).index(o.colour) for o in scene.objects])
    shape_of = np.array([0] + [1 + scenes.SHAPES.index(o.shape) for o in scene.objects])
    return colour_of[owner].astype(np.int32), shape_of[owner].astype(np.int32)


def dataset(cfg, config: PretrainConfig, preprocess: Callable[[list], np.ndarray]) -> dict[str, np.ndarray]:
    """`config.dataset` training scenes: pixels [N, 3, S, S] (`preprocess`: PIL images -> pixel
    values, the model's own processor), colour/shape labels [N, P]."""
    size, patch = cfg.image_size, cfg.patch_size
    samples = [scenes.single_picture_sample("train", config.seed, 10**7 + i) for i in range(config.dataset)]
    pixels = preprocess([scenes.render(s.scene, size) for s in samples])
    labels = [patch_labels(s.scene, size, patch) for s in samples]
    return {"pixels": pixels, "colour": np.stack([c for c, _ in labels]), "shape": np.stack([s for _, s in labels])}


def init_head(cfg, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    classes = 1 + len(scenes.COLOURS) + 1 + len(scenes.SHAPES)
    return {"w": jnp.asarray(0.02 * rng.standard_normal((cfg.hidden_size, classes)), jnp.float32),
            "b": jnp.zeros((classes,), jnp.float32)}


def patch_loss(cfg, tower: dict, head: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy, accuracy) of colour and shape per patch, from the last layer's patch features."""
    h = clip.hidden_states(cfg, tower, batch["pixels"], depth=cfg.num_layers)[-1][:, 1:]  # [N, P, Hv]
    logits = h @ head["w"] + head["b"]
    n_colour = 1 + len(scenes.COLOURS)
    losses, accuracy = [], []
    for part, labels in ((logits[..., :n_colour], batch["colour"]), (logits[..., n_colour:], batch["shape"])):
        losses.append(optax.softmax_cross_entropy_with_integer_labels(part, labels).mean())
        accuracy.append((part.argmax(-1) == labels).mean())
    return sum(losses), sum(accuracy) / 2


def pretrain(cfg, tower: dict, preprocess: Callable[[list], np.ndarray], config: PretrainConfig,
             progress: bool = True) -> tuple[dict, list[dict]]:
    """Train `tower` (CLIP params, cfg: CLIPVisionConfig) on patch labels -> (tower, log records)."""
    from tqdm import tqdm

    data = dataset(cfg, config, preprocess)
    head = init_head(cfg, config.seed)
    warmup = min(config.warmup_steps, config.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, config.steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.05))
    params = {"tower": jax.tree.map(jnp.array, tower), "head": head}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, acc), grads = jax.value_and_grad(
            lambda p: patch_loss(cfg, p["tower"], p["head"], batch), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    rng = np.random.default_rng(config.seed)
    log = []
    for s in tqdm(range(config.steps), desc="pretrain tower", unit="step", disable=not progress):
        index = rng.choice(config.dataset, config.batch_size, replace=False)
        params, opt_state, loss, acc = step(params, opt_state, {k: jnp.asarray(v[index]) for k, v in data.items()})
        log.append({"pretrain_step": s + 1, "loss": float(loss), "patch_accuracy": float(acc)})
    return jax.device_get(params["tower"]), log

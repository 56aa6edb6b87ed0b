"""LLaVA stage 2 in JAX: low-rank adapters on every decoder layer, trained with the projector.

LLaVA-1.5's second stage (visual instruction tuning) trains the language model itself; here the
decoder learns through LoRA adapters (`lookm_jax.train.adapters`) on each layer's fused q/k/v, output,
fused gate/up and down projections, while the projector trains at its own rate and the tower stays as
stage 1 left it. The loss is the cross-entropy of the answer tokens only, over conversations rendered
with the chat template exactly as `Model.encode_chat` renders them (`lookm_jax.train.data`): single
pictures with 1-3 objects and 1-16 one-object pictures behind "Picture k:" markers, every question
kind of `scenes.PICTURE_KINDS`, a text fact between the pictures. Batch kinds cycle with the step
(`DecoderConfig.batches`); each compiles once.

Every step also replays a batch of text-only prompts with the frozen decoder's own greedy continuations
(`lookm_jax.train.replay`): the adapted decoder's next-token distributions over them are pulled to the
frozen decoder's (KL, at every position), so that text behaviour stays the frozen model's. Measured:
cross-entropy on the greedy tokens alone let teacher-forced agreement on held-out prompts fall to 0.84
by step 100.

Optionally (`DecoderConfig.read_weight`), a read loss supervises where the answer looks: in the chosen
layers, the share of the attention from an answer's position to the picture that lands on the patches of
the object(s) the answer is about (`Batch.read_mask`). Measured on DEMO_BUILD 9, at the first answer
token of a question about one object of several: the heads of layers 19-26 give the named object 0.05-0.21
of their image attention, for patches that are 0.06 of the picture; supervising it (weight 0.2, layers
8-26) made DEMO_BUILD 10 (docs/RESULTS.md).

Optionally (`DecoderConfig.subspace_dims`), each adapter reads only the input directions that picture
conversations use and text-only prompts do not (`lookm_jax.train.subspace`), computed once from the
model the run starts from and kept in the run folder (SUBSPACE_FILE).

Checkpoints, resume and the NaN stop are stage 1's (`lookm_jax.train.runs`): step s's data is
a pure function of (seed, s), so a killed and resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lookm_jax import scenes
from lookm_jax.checks import is_real
from lookm_jax.models import llama, llava
from lookm_jax.train import adapters as lora
from lookm_jax.train import replay, subspace, tower
from lookm_jax.train.runs import (LOG, arrays_of, end_step, jit_step, load_checkpoint, save_checkpoint, truncate_log,
                                  write_atomic)
from lookm_jax.train.data import Batch, BatchSpec, Encoder, single_picture_spec
from lookm_jax.train.vision import embedded_answer_metrics


def _pictures(batch_size: int, low: int, high: int, turns: int, length: int, max_targets: int,
              text_facts: bool = True, kinds: tuple[str, ...] = scenes.PICTURE_KINDS) -> BatchSpec:
    return BatchSpec(batch_size=batch_size, pictures=high, min_pictures=low, turns=turns, length=length,
                     max_targets=max_targets, text_facts=text_facts, kinds=kinds)


# Static lengths measured over 300 training samples each with the demo's tokenizer: at most 417 / 743 /
# 1361 tokens and 24 / 30 / 43 answer tokens for 1-4 / 5-8 / 9-16 pictures with 4 / 6 / 8 turns.
DEFAULT_BATCHES = (
    single_picture_spec(batch_size=8, turns=3),
    _pictures(4, 1, 4, turns=4, length=448, max_targets=32),
    _pictures(2, 5, 8, turns=6, length=768, max_targets=40),
    _pictures(1, 9, 16, turns=8, length=1408, max_targets=56),
    _pictures(2, 5, 8, turns=6, length=768, max_targets=40),
)
REPLAY_LENGTH = 128  # a chat-rendered replay prompt (<= 60 tokens templated, <= 80 generated) + its continuation (<= 32)
ADAPTERS_FILE, VISION_FILE = "demo_adapters.safetensors", "demo_vision.safetensors"  # a run's exported weights
SHIPPED = "shipped"  # `DecoderConfig.init`: start from the demo's shipped adapters and projector
SUBSPACE_FILE = "adapter_subspace.safetensors"  # a restricted run's bases (`subspace`), made at its start
SUBSPACE_ROUNDS = 2  # the picture moments are summed over the first SUBSPACE_ROUNDS x len(batches) steps' batches
SUBSPACE_TEXT_ROWS = 16  # replay prompts per batch of the text moments


def weighted_batches(weights: dict[str, int], batches: tuple[BatchSpec, ...] = DEFAULT_BATCHES) -> tuple[BatchSpec, ...]:
    """`batches` whose multi-picture samples draw question kinds in proportion to `weights` (kind ->
    a whole number >= 1; kinds not named weigh 1): each kind is repeated that often in the spec's
    `kinds`, from which `scenes.multi_picture_sample` draws. Single-picture specs are unchanged."""
    for kind, weight in weights.items():
        if kind not in scenes.PICTURE_KINDS:
            raise ValueError(f"unknown question kind {kind!r}; expected one of {scenes.PICTURE_KINDS}")
        if not isinstance(weight, int) or weight < 1:
            raise ValueError(f"the weight of {kind} must be a whole number >= 1, got {weight!r}")
    return tuple(spec if spec.pictures == 1 else dataclasses.replace(
        spec, kinds=tuple(k for k in spec.kinds for _ in range(weights.get(k, 1)))) for spec in batches)


# Static (length, answer tokens) of the default multi-picture batches when counts are answered in
# another form, measured like DEFAULT_BATCHES' (listed over 300 training samples each, tallied over 1000 of
# seeds 0 and 4): listed at most 418 / 754 / 1385 tokens and 27 / 43 / 68 answer tokens for 1-4 / 5-8 /
# 9-16 pictures, tallied 439 / 790 / 1560 and 88 / 188 / 474; the static shapes keep a margin.
COUNT_FORM_SHAPES = {"listed": {4: (448, 32), 8: (768, 56), 16: (1408, 88)},
                     "tallied": {4: (448, 96), 8: (816, 208), 16: (1600, 512)}}


def with_count_form(form: str, batches: tuple[BatchSpec, ...] = DEFAULT_BATCHES) -> tuple[BatchSpec, ...]:
    """`batches` whose multi-picture samples answer a count of pictures in `form` (`scenes.COUNT_FORMS`,
    e.g. "1 square (one), 2 circle (one): one." tallied), with room for the longer answers. Single-picture
    specs are unchanged."""
    if form not in scenes.COUNT_FORMS:
        raise ValueError(f"count form must be one of {scenes.COUNT_FORMS}, got {form!r}")
    if form != scenes.COUNT_FORMS[0] and any(spec.kinds.count("count_pictures") > 1 for spec in batches):
        raise ValueError(f"counts answered {form} take static shapes measured with counts drawn as often as every other "
                         "kind: not with a count_pictures kind weight")
    shapes = COUNT_FORM_SHAPES.get(form, {})

    def widened(spec: BatchSpec) -> BatchSpec:
        length, targets = shapes.get(spec.pictures, (0, 0))
        return dataclasses.replace(spec, count_form=form, length=max(spec.length, length),
                                   max_targets=max(spec.max_targets, targets))
    return tuple(spec if spec.pictures == 1 else widened(spec) for spec in batches)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    steps: int = 600
    rank: int = 16
    scale: float = 2.0  # LoRA's alpha / rank: the adapted weight is W + scale * b @ a
    learning_rate: float = 3e-4  # the adapters' peak AdamW rate; 0 keeps the init's (only the projector trains)
    projector_learning_rate: float = 1e-4
    warmup_steps: int = 30
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    seed: int = 0
    batches: tuple[BatchSpec, ...] = DEFAULT_BATCHES  # step s (1-based) uses batches[(s - 1) % len]
    replay_batch_size: int = 4  # text-only replay conversations added to every step
    replay_weight: float = 1.0
    replay_generated: int = 0  # prompts the frozen decoder writes itself, added to the train replay bank
    image_norm_weight: float = 0.1  # stage 1's penalty on the image tokens' norms (`vision.TrainConfig`)
    read_weight: float = 0.0  # weight of the read loss (`read_loss`); 0 = off
    read_layers: tuple[int, ...] = ()  # the decoder layers whose attention the read loss supervises
    eval_every: int = 100
    checkpoint_every: int = 10
    eval_samples: int = 32  # held-out questions per split at each evaluation
    init: str | None = None  # a finished run's folder, or SHIPPED: its adapters and projector start this run
    init_scale: float = 1.0  # the init's adapters start scaled by this (b x init_scale)
    subspace_dims: int = 0  # > 0: each adapter reads only that many input directions (`subspace`); 0: all
    adapted_tokens: str = lora.ADAPTED_TOKENS[0]  # "image": the adapters act on image tokens only, no replay needed
    FREE_ON_RESUME: ClassVar[tuple[str, ...]] = ("eval_every", "checkpoint_every", "eval_samples")

    def __post_init__(self):
        for name in ("steps", "rank", "eval_every", "checkpoint_every", "eval_samples", "replay_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("scale", "learning_rate", "projector_learning_rate", "replay_weight", "image_norm_weight",
                     "read_weight"):
            if not is_real(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.learning_rate == 0 == self.projector_learning_rate:
            raise ValueError("learning_rate and projector_learning_rate are both 0: nothing would train")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"need 0 <= warmup_steps < steps, got {self.warmup_steps}, {self.steps}")
        if not is_real(self.init_scale) or self.init_scale <= 0 or (self.init is None and self.init_scale != 1):
            raise ValueError(f"init_scale must be a finite number > 0, and 1 without an init, got {self.init_scale} "
                             f"(init {self.init})")
        if self.replay_generated < 0:
            raise ValueError(f"replay_generated must be >= 0, got {self.replay_generated}")
        if self.replay_generated and not 1 <= self.replay_batch_size // 2 <= self.replay_generated:
            raise ValueError(f"replay_generated > 0 needs replay_batch_size >= 2 and replay_generated >= half of it (the "
                             f"generated prompts' rows of a step), got {self.replay_generated} and {self.replay_batch_size}")
        if self.adapted_tokens not in lora.ADAPTED_TOKENS:
            raise ValueError(f"adapted_tokens must be one of {lora.ADAPTED_TOKENS}, got {self.adapted_tokens!r}")
        if self.image_only and (self.replay_weight or self.replay_generated):
            raise ValueError("adapted_tokens 'image' leaves every text-only prompt to the frozen decoder exactly: "
                             f"replay_weight and replay_generated must be 0, got {self.replay_weight} and "
                             f"{self.replay_generated}")
        if self.subspace_dims < 0:
            raise ValueError(f"subspace_dims must be >= 0 (0: adapters read every input direction), got {self.subspace_dims}")
        if not self.batches:
            raise ValueError("batches must name at least one batch kind")
        layers = self.read_layers
        if not all(isinstance(n, int) and n >= 0 for n in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"read_layers must be distinct layer indices >= 0, got {layers}")
        if self.read_weight > 0 and not layers:
            raise ValueError("read_weight > 0 needs read_layers: the layers whose attention it supervises")

    @property
    def image_only(self) -> bool:
        return self.adapted_tokens == "image"

    def spec(self, step: int) -> BatchSpec:
        return self.batches[(step - 1) % len(self.batches)]


def initial_trainable(model, config: DecoderConfig) -> dict:
    """{"adapters", "projector"} the run starts from: fresh adapters (LoRA's init) and `model`'s projector,
    or those of `config.init` (exported b x `config.init_scale` / `config.scale`, so the adapted decoder
    is the one exported, its adapters scaled by init_scale). Refuses an init of another rank or trained
    over another tower than `model`'s."""
    from lookm_jax import loading

    text = model.params["text"]
    if config.init is None:
        return {"adapters": lora.init(text, config.rank, config.seed),
                "projector": jax.tree.map(jnp.array, model.params["projector"])}  # own copies: the step donates
    if config.init == SHIPPED:
        adapters_path, vision_path = loading.DEMO_ADAPTERS_WEIGHTS, loading.DEMO_VISION_WEIGHTS
    else:
        adapters_path, vision_path = (os.path.join(config.init, name) for name in (ADAPTERS_FILE, VISION_FILE))
    exported = loading.read_demo_adapters(adapters_path, text)
    rank = int(exported[0][llama.ADAPTED_WEIGHTS[0]]["a"].shape[0])
    if rank != config.rank:
        raise ValueError(f"--init {config.init}: its adapters have rank {rank}, this run's rank is {config.rank}")
    vision = loading.read_demo_vision(vision_path)
    same_tower = jax.tree.structure(vision["vision"]) == jax.tree.structure(model.params["vision"]) and jax.tree.all(
        jax.tree.map(np.array_equal, vision["vision"], model.params["vision"]))
    if not same_tower:
        raise ValueError(f"--init {config.init}: its projector was trained over another tower than the one this run uses")
    factor = config.init_scale / config.scale
    adapters = jax.tree.map(jnp.asarray, tuple({name: {"a": ad["a"], "b": ad["b"] * factor}
                                                for name, ad in layer.items()} for layer in exported))
    return {"adapters": adapters, "projector": jax.tree.map(jnp.asarray, vision["projector"])}


def optimizer(config: DecoderConfig) -> optax.GradientTransformation:
    """AdamW (warmup + cosine to 2% of the peak) after global-norm clipping: the adapters at
    `learning_rate`, the projector at `projector_learning_rate` (either frozen when 0)."""
    def adamw(peak: float) -> optax.GradientTransformation:
        if peak == 0:
            return optax.set_to_zero()
        schedule = optax.warmup_cosine_decay_schedule(0.0, peak, config.warmup_steps, config.steps,
                                                      end_value=peak * 0.02)
        return optax.adamw(schedule, weight_decay=config.weight_decay)

    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.multi_transform({"adapters": adamw(config.learning_rate),
                                              "projector": adamw(config.projector_learning_rate)},
                                             lambda params: {k: k for k in params}))


def adapted_text(frozen: dict, adapters: lora.Adapters, scale: float, tokens: jax.Array | None = None) -> dict:
    """The frozen text params with `adapters` applied on the fly (at the `tokens` [B, L] marked only, when
    given), restricted to frozen["subspace"] if a run has one."""
    if "subspace" in frozen:
        adapters = subspace.restrict(adapters, frozen["subspace"])
    return lora.apply(frozen["text"], adapters, scale, tokens)


def adapter_subspace(model, config: DecoderConfig, initial: dict, output: str, batch_fn: Callable[[int], Batch],
                     bank: replay.Bank, progress: bool = True) -> subspace.Bases:
    """The run's `subspace.Bases`: picture conversations (the first SUBSPACE_ROUNDS x len(config.batches)
    steps' batches, through the model the run starts from: `initial`'s adapters, unrestricted, and
    projector) against the train replay bank's prompts and continuations (through the frozen decoder).
    Made once into SUBSPACE_FILE in `output` and read back on resume; made again if it was made for
    other settings (dims, init, seed, batches, the replay bank's size)."""
    from safetensors import safe_open
    from safetensors.numpy import save
    from tqdm import tqdm

    path = os.path.join(output, SUBSPACE_FILE)
    text = model.params["text"]
    made_for = {"subspace_dims": str(config.subspace_dims), "init": str(config.init), "seed": str(config.seed),
                "batches": repr(config.batches), "replay_prompts": str(len(bank.prompts))}
    if os.path.exists(path):
        with safe_open(path, "np") as saved:
            if saved.metadata() == made_for:
                return subspace.unflatten({name: saved.get_tensor(name) for name in saved.keys()}, len(text["layers"]))
    cfg = model.config

    @jax.jit
    def moments_of(params, ids, pixel_values, valid):  # pixel_values None: text only
        x, _ = llava.embed(cfg, params, ids, pixel_values)
        return subspace.input_moments(cfg.text, params["text"], x, valid)

    started = {"text": lora.apply(text, initial["adapters"], config.scale), "vision": model.params["vision"],
               "projector": initial["projector"]}
    frozen = {**started, "text": text}
    totals = {"pictures": {}, "text": {}}

    def add(kind: str, moments: dict) -> None:  # summed on the host in float64
        for name, m in moments.items():
            totals[kind][name] = totals[kind].get(name, 0.0) + np.asarray(m, np.float64)

    steps, rows = SUBSPACE_ROUNDS * len(config.batches), len(bank.prompts)
    bar = tqdm(total=steps + -(-rows // SUBSPACE_TEXT_ROWS), desc="adapter subspace", unit="batch", disable=not progress)
    for step in range(1, steps + 1):
        batch = batch_fn(step)
        add("pictures", moments_of(started, batch.ids, batch.pixel_values, batch.valid))
        bar.update(1)
    for first in range(0, rows, SUBSPACE_TEXT_ROWS):
        chunk = replay_batch(bank, range(first, min(first + SUBSPACE_TEXT_ROWS, rows)))
        pad = ((0, SUBSPACE_TEXT_ROWS - len(chunk["ids"])), (0, 0))  # one shape for every chunk
        add("text", moments_of(frozen, np.pad(chunk["ids"], pad), None, np.pad(chunk["valid"], pad)))
        bar.update(1)
    bar.close()
    made = subspace.bases(totals["pictures"], totals["text"], config.subspace_dims)
    write_atomic(path, save(subspace.flatten(made), metadata=made_for))
    return made


def replay_batch(bank: replay.Bank, indices, length: int = REPLAY_LENGTH) -> dict[str, np.ndarray]:
    """Bank rows `indices` as a `Batch`-shaped dict without pictures: each prompt's ids, then its
    frozen continuation, which is the target (`answer_start` marks its first token)."""
    rows = len(indices)
    out = {"ids": np.zeros((rows, length), np.int32), "valid": np.zeros((rows, length), bool),
           "target_positions": np.zeros((rows, replay.REPLAY_TOKENS), np.int32),
           "targets": np.zeros((rows, replay.REPLAY_TOKENS), np.int32),
           "target_mask": np.zeros((rows, replay.REPLAY_TOKENS), bool),
           "answer_start": np.zeros((rows, replay.REPLAY_TOKENS), bool)}
    for row, i in enumerate(indices):
        prompt, answer = bank.prompt_ids[i], bank.continuations[i]
        ids = list(prompt) + list(answer)
        if len(ids) > length:
            raise ValueError(f"replay prompt {i} with its continuation is {len(ids)} tokens, over {length}")
        n = len(answer)
        out["ids"][row, :len(ids)], out["valid"][row, :len(ids)] = ids, True
        out["target_positions"][row, :n] = np.arange(len(prompt) - 1, len(ids) - 1)
        out["targets"][row, :n], out["target_mask"][row, :n] = answer, True
        out["answer_start"][row, 0] = True
    return out


def replay_rows(rng: np.random.Generator, bank_size: int, generated: int, count: int) -> np.ndarray:
    """`count` distinct rows of a replay bank whose last `generated` prompts the frozen decoder wrote
    itself: half of them (rounded down) drawn from those, the rest from the templated ones, so each
    templated prompt (the Paris question among them) is replayed at least half as often as without
    generated prompts, not a tenth as often as a uniform draw over 162 + 1500 would."""
    mixed = count // 2 if generated else 0
    templated = bank_size - generated
    return np.concatenate([rng.choice(templated, count - mixed, replace=False),
                           templated + rng.choice(generated, mixed, replace=False)])


def replay_metrics(text_cfg, adapted: dict, frozen: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(KL(frozen || adapted) of the next-token distributions, mean over every position of a replay
    batch whose next token is in it, prompt and continuation alike; the share of the continuation's
    tokens the adapted decoder still predicts, teacher-forced). The frozen pass gets no gradient."""
    x = llama.embed_tokens(frozen, batch["ids"])

    def log_probs(params):  # [B, L, V] fp32
        return jax.nn.log_softmax(llama.lm_logits(params, llama.forward(text_cfg, params, x, batch["valid"])))

    ours, theirs = log_probs(adapted), jax.lax.stop_gradient(log_probs(frozen))
    kl = (jnp.exp(theirs) * (theirs - ours)).sum(-1)  # [B, L]
    has_next = batch["valid"] & jnp.roll(batch["valid"], -1, axis=1).at[:, -1].set(False)
    kl = jnp.where(has_next, kl, 0.0).sum() / jnp.maximum(has_next.sum(), 1)
    at_targets = jnp.take_along_axis(ours, batch["target_positions"][..., None], axis=1)  # [B, T, V]
    hit = (jnp.argmax(at_targets, -1) == batch["targets"]) & batch["target_mask"]
    return kl, hit.sum() / jnp.maximum(batch["target_mask"].sum(), 1)


def read_shares(text_cfg, text: dict, x: jax.Array, is_image: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The decoder's pass over embedded prompts x [B, L, H] -> (final-normed h [B, L, H], log shares
    [N, B, A]): in every layer, the log of the share of the attention from each target's position to
    the image tokens that lands on the tokens its answer reads (`Batch.read_mask`), attention summed
    over the heads first, so the heads that look at the pictures most weigh most. Computed from log
    probabilities (no division by a vanishing image mass); 0 for targets that read nothing."""
    positions, valid = batch["target_positions"], batch["valid"]  # [B, A], [B, L]
    causal = (jnp.arange(x.shape[1]) <= positions[..., None]) & valid[:, None, :]  # [B, A, L]
    reads = (batch["read_mask"] & causal).any(-1, keepdims=True)  # [B, A, 1]
    # A target that reads nothing gets every key it sees as both sets (a finite log share of 0, no NaN gradient).
    on_read = jnp.where(reads, batch["read_mask"] & causal, causal)[:, :, None]  # [B, A, 1, L]
    on_image = jnp.where(reads, is_image[:, None, :] & causal, causal)[:, :, None]

    def on_layer(q, k, v, stats, index):
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        at = jnp.take_along_axis(q, positions[:, None, :, None], axis=2)  # [B, Hq, A, D]
        at = at.reshape(b, hkv, hq // hkv, -1, d)  # a KV head's query heads together, as `llama.attend`
        scores = jnp.einsum("bhgad,bhkd->bhgak", at, k, preferred_element_type=jnp.float32) * d**-0.5
        log_probs = jax.nn.log_softmax(jnp.where(causal[:, None, None], scores, -jnp.inf), axis=-1)
        log_probs = log_probs.reshape(b, hq, -1, log_probs.shape[-1]).transpose(0, 2, 1, 3)  # [B, A, Hq, L]

        def log_mass(keys):  # log of the attention on `keys`, summed over heads -> [B, A]
            return jax.nn.logsumexp(jnp.where(keys, log_probs, -jnp.inf), axis=(-2, -1))

        return log_mass(on_read) - log_mass(on_image)

    h, log_shares = llama.encode(text_cfg, text, x, valid, on_layer=on_layer)
    return h, log_shares


def read_loss(log_shares: jax.Array, read_mask: jax.Array, layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(minus the mean of `read_shares`' log shares over `layers` and the answers that read some image
    token, the mean share itself). Pushes the attention from an answer's position onto what it must read."""
    has_read = read_mask.any(-1).astype(jnp.float32)  # [B, A]
    picked = log_shares[jnp.asarray(layers)]  # [S, B, A]
    count = jnp.maximum(has_read.sum() * len(layers), 1.0)
    return -(picked * has_read).sum() / count, (jnp.exp(picked) * has_read).sum() / count


def metrics_fn(cfg, scale: float, read_layers: tuple[int, ...] = (), image_only: bool = False) -> Callable:
    """(trainable, frozen, batch) -> (picture answer loss, metrics): the adapted model's
    `vision.answer_metrics` (+ "replay_kl", "replay_accuracy" of `replay_metrics` when batch has "replay";
    + "read_loss", "read_share" of `read_loss` over `read_layers` when given). `image_only`: the adapters
    act on the batch's image tokens only."""
    def metrics(trainable, frozen, batch):
        tokens = llava.image_mask(cfg, batch["ids"]) if image_only else None
        text = adapted_text(frozen, trainable["adapters"], scale, tokens)
        params = {"text": text, "vision": frozen["vision"], "projector": trainable["projector"]}
        x, is_image = llava.embed(cfg, params, batch["ids"], batch["pixel_values"])
        if read_layers:
            h, shares = read_shares(cfg.text, text, x, is_image, batch)
            loss, out = embedded_answer_metrics(cfg.text, text, x, is_image, batch, forward=lambda *_: h)
            out["read_loss"], out["read_share"] = read_loss(shares, batch["read_mask"], read_layers)
        else:
            loss, out = embedded_answer_metrics(cfg.text, text, x, is_image, batch)
        if "replay" in batch:
            kl, accuracy = replay_metrics(cfg.text, text, frozen["text"], batch["replay"])
            out = {**out, "replay_kl": kl, "replay_accuracy": accuracy}
        return loss, out
    return metrics


def make_step(cfg, tx: optax.GradientTransformation, config: DecoderConfig) -> Callable:
    """(trainable, opt_state, frozen, batch) -> (trainable, opt_state, answer loss, metrics).

    Minimises the picture answer loss + replay_weight x the replay KL + image_norm_weight x the
    image-norm penalty (+ read_weight x the read loss, when on). Jitted, the trainable parameters and
    optimizer state donated; static through the closure: the model config, the optimizer and the
    weights. Each batch kind compiles once."""
    metrics = metrics_fn(cfg, config.scale, config.read_layers if config.read_weight else (), config.image_only)

    def objective(trainable, frozen, batch):
        loss, out = metrics(trainable, frozen, batch)
        total = loss + config.image_norm_weight * out["image_norm"]
        if "replay" in batch:
            total += config.replay_weight * out["replay_kl"]
        if config.read_weight:
            total += config.read_weight * out["read_loss"]
        return total, (loss, out)

    return jit_step(objective, tx)


class HeldOut:
    """Teacher-forced first-answer-token accuracy on fixed held-out batches: single pictures, the
    held-out colour-shape combination, 8 pictures (every one-word kind of `scenes.PICTURE_KINDS`:
    "describe" starts with "A"; counts answered in the form the run trains, except tallied ones, whose
    first token is always "1"), and the held-out
    replay prompts' continuations (every token; not when `held_out_bank` is None: image-only adapters)."""

    def __init__(self, encoder: Encoder, config: DecoderConfig, image_size: int, held_out_bank: replay.Bank | None,
                 batch_size: int = 8):
        count = -(-config.eval_samples // batch_size)
        single = single_picture_spec(batch_size, turns=1)
        forms = [spec.count_form for spec in config.batches if spec.pictures > 1]
        form = forms[0] if forms else scenes.COUNT_FORMS[0]
        one_word = tuple(k for k in scenes.PICTURE_KINDS if k != "describe" and (k, form) != ("count_pictures", "tallied"))
        # 8 pictures, one turn: at most 613 tokens and 15 answer tokens (a listed count) over 300 samples
        eight = dataclasses.replace(_pictures(batch_size // 2, 8, 8, turns=1, length=704, max_targets=16,
                                              text_facts=False, kinds=one_word), count_form=form)
        self.batches = {split: [arrays_of(single.make(encoder, split, config.seed, i * batch_size, image_size))
                                for i in range(count)] for split in ("heldout", "combination")}
        self.batches["eight_pictures"] = [arrays_of(eight.make(encoder, "heldout", config.seed, i * eight.batch_size,
                                                               image_size)) for i in range(2 * count)]
        rows = 0 if held_out_bank is None else min(config.eval_samples, len(held_out_bank.prompts))
        self.replay = [jax.tree.map(jnp.asarray, replay_batch(held_out_bank, range(i, min(i + batch_size, rows))))
                       for i in range(0, rows, batch_size)]

    def __call__(self, metrics: Callable, token_accuracy: Callable, trainable: dict, frozen: dict) -> dict[str, float]:
        out = {f"{split}_accuracy": float(np.mean([float(metrics(trainable, frozen, b)[1]["accuracy"])
                                                   for b in batches])) for split, batches in self.batches.items()}
        if self.replay:
            tokens = [float(token_accuracy(trainable, frozen, b)) for b in self.replay]
            out["replay_heldout_token_accuracy"] = float(np.mean(tokens))
        return out


def _replay_token_accuracy(cfg, scale: float) -> Callable:
    """(trainable, frozen, replay batch) -> share of the continuation's tokens predicted (teacher-forced)."""
    def accuracy(trainable, frozen, batch):
        return replay_metrics(cfg.text, adapted_text(frozen, trainable["adapters"], scale), frozen["text"], batch)[1]
    return jax.jit(accuracy)


def train(model, config: DecoderConfig, output: str, *, batch_fn: Callable[[int], Batch] | None = None,
          replay_bank: replay.Bank | None = None, stop_after: int | None = None, progress: bool = True) -> dict:
    """Train adapters on `model`'s decoder and its projector into `output` (resuming its checkpoint).

    `batch_fn(step)` and `replay_bank` override the scene batches and the frozen model's replay bank
    (tests use fixed ones); `stop_after` ends this call after that many steps, as a kill would after the
    last checkpoint. Returns {"adapters": ..., "projector": ...} on the host (the adapters restricted to the
    run's subspace, if it has one: what the decoder applies).
    """
    from tqdm import tqdm

    cfg = model.config
    if any(n >= cfg.text.num_layers for n in config.read_layers):
        raise ValueError(f"read_layers must be < the decoder's {cfg.text.num_layers} layers, got {config.read_layers}")
    narrowest = min(lora.matrix_shape(w)[1] for w in (model.params["text"]["layers"][0][n] for n in llama.ADAPTED_WEIGHTS))
    if config.subspace_dims > narrowest:
        raise ValueError(f"subspace_dims must be in 0..{narrowest} (the narrowest adapted input), got {config.subspace_dims}")
    os.makedirs(output, exist_ok=True)
    frozen = {"text": model.params["text"], "vision": model.params["vision"]}
    trainable = initial = initial_trainable(model, config)
    tx = optimizer(config)
    opt_state = tx.init(trainable)
    step = 0
    restored = load_checkpoint(output, trainable, opt_state, config)
    if restored is not None:
        step, trainable, opt_state = restored
        truncate_log(os.path.join(output, LOG), step)
    train_bank = None if config.image_only else (
        replay_bank or replay.bank(model, output, "train", config.seed, config.replay_generated, progress))
    encoder = Encoder.of(model) if batch_fn is None else None
    image_size = cfg.pixel_shape[-1]
    if batch_fn is None:
        def batch_fn(s: int) -> Batch:
            spec = config.spec(s)
            return spec.make(encoder, "train", config.seed, (s - 1) * spec.batch_size, image_size)
    if config.subspace_dims:
        frozen["subspace"] = adapter_subspace(model, config, initial, output, batch_fn, train_bank, progress)
    held_out = None
    if encoder is not None:
        held_out = HeldOut(encoder, config, image_size,
                           None if config.image_only else replay.bank(model, output, "heldout", config.seed))
    train_step = make_step(cfg, tx, config)
    metrics = jax.jit(metrics_fn(cfg, config.scale, image_only=config.image_only))
    token_accuracy = _replay_token_accuracy(cfg, config.scale)
    last = config.steps if stop_after is None else min(config.steps, step + stop_after)
    bar = tqdm(total=config.steps, initial=step, desc="train decoder", unit="step", disable=not progress)
    log = open(os.path.join(output, LOG), "a")
    start, tokens = time.perf_counter(), 0
    while step < last:
        step += 1
        batch = batch_fn(step)
        arrays = arrays_of(batch)
        if train_bank is not None:
            rng = np.random.default_rng([config.seed, step])  # seeded by the step: a resumed run draws the same
            rows = replay_rows(rng, len(train_bank.prompts), config.replay_generated, config.replay_batch_size)
            arrays["replay"] = jax.tree.map(jnp.asarray, replay_batch(train_bank, rows))
            tokens += int(arrays["replay"]["valid"].sum())
        trainable, opt_state, loss, step_metrics = train_step(trainable, opt_state, frozen, arrays)
        loss = float(loss)
        tower.check_finite("stage-2", loss, step, config.learning_rate)
        tokens += int(batch.valid.sum())
        record = {"step": step, "loss": loss, **{k: float(v) for k, v in step_metrics.items()},
                  "pictures": int(batch.pixel_values.shape[0] // batch.ids.shape[0])}
        bar.update(1)
        kl = {} if train_bank is None else {"kl": f"{record['replay_kl']:.4f}"}
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{record['accuracy']:.2f}", **kl,
                        tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        end_step(log, bar, record, config, last, start,
                 None if held_out is None else lambda: held_out(metrics, token_accuracy, trainable, frozen),
                 lambda: save_checkpoint(output, step, trainable, opt_state, config))
    bar.close()
    log.close()
    if config.subspace_dims:
        trainable = {**trainable, "adapters": subspace.restrict(trainable["adapters"], frozen["subspace"])}
    return jax.device_get(trainable)


def export_adapters(path: str, adapters: lora.Adapters, scale: float, metadata: dict[str, str]) -> None:
    """The adapters as one safetensors file ("layers.{i}.{weight}.a" / ".b"), b scaled by `scale`
    (so that folding adds b @ a), float16, written atomically; `loading.read_demo_adapters` reads it."""
    from safetensors.numpy import save

    scaled = tuple({name: {"a": ad["a"], "b": scale * np.asarray(ad["b"])} for name, ad in layer.items()}
                   for layer in adapters)
    flat = {k: v.astype(np.float16) for k, v in lora.flatten(scaled).items()}
    write_atomic(path, save(flat, metadata=metadata))

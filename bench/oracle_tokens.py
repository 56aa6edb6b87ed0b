"""How far stage 1 gets when the image tokens come from the scene's TRUE patch labels (issue 10).

    python bench/oracle_tokens.py [--steps 300] [--eval-every 50] [--save PATH.npz] [--json PATH]
    python bench/oracle_tokens.py --init PATH.npz --first-sample 4800 --learning-rate 3e-4 ...   # continue
    python bench/oracle_tokens.py --adapter-rank 16 --adapter-mlp-rank 64 ...   # + image-position adapters

An oracle stands in for tower + projector: each patch's labels (`tower.patch_labels`: colour or
background, and on an object its shape, side and half; everywhere the object count), one-hot, plus
a learned embedding of the patch's position, through a 2-layer GELU MLP to the decoder's width. It
is trained as `lookm train vision --turns 1 --batch-size 16` trains the projector: single-picture
first questions (training split, seed 7), answer tokens only, stage 1's optimizer and image-norm
penalty, through the frozen SmolLM2 decoder. Every --eval-every steps it prints teacher-forced
first-answer-token accuracy on the 120 selection questions (held-out split, seed 1), the bar's 60
(seed 0) and the 24 held-out combinations; for the shipped weights this measure equals their greedy
accuracy. No tower behind this projector and decoder can carry more than these labels do, so the
oracle's curve bounds what the trained vision side can reach with the same steps.

--adapter-rank R asks what capacity beside the frozen decoder buys: every decoder layer gets
weights that act at image positions only (text positions run the frozen decoder unchanged), a
rank-R update of its q/k/v projection and a SiLU MLP of width --adapter-mlp-rank on the layer's
output, added to it (after the layer's own MLP), trained with the oracle (zero-initialised, so step
1 is the plain decoder's). --init restores saved adapters; their ranks are then the saved ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

from bench_args import at_least, json_path
from lookm_jax.cli_args import positive_float

EVALUATIONS = (("selection", "heldout", 120, 1), ("bar", "heldout", 60, 0), ("combination", "combination", 24, 0))
BATCH, LENGTH, TARGETS, DATA_SEED = 16, 128, 4, 7  # `single_picture_spec(16, turns=1)`'s static shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=at_least(1), default=300, help="training steps (the cosine's length)")
    parser.add_argument("--learning-rate", type=positive_float, default=1e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup-steps", type=at_least(0), default=20)
    parser.add_argument("--eval-every", type=at_least(1), default=50)
    parser.add_argument("--init", metavar="NPZ", help="start from an oracle saved by --save")
    parser.add_argument("--first-sample", type=at_least(0), default=0,
                        help="training scene of step 1 (a continuation passes the steps x 16 already seen)")
    parser.add_argument("--save", metavar="NPZ", help="write the oracle's parameters (and adapters) here at every evaluation")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write the curves to PATH")
    parser.add_argument("--adapter-rank", type=at_least(0), default=0,
                        help="rank of the image-position q/k/v update in every decoder layer (0: none)")
    parser.add_argument("--adapter-mlp-rank", type=at_least(1), default=64,
                        help="width of the image-position MLP after every decoder layer's (with --adapter-rank)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    from lookm_jax import loading, scenes
    from lookm_jax.eval import scenes as scene_eval
    from lookm_jax.models import llama, llava
    from lookm_jax.models.layers import rms_norm
    from lookm_jax.train import tower, vision
    from lookm_jax.train.data import Encoder, single_picture_conversation

    model = loading.demo_model()
    cfg, encoder, text = model.config, Encoder.of(model), model.params["text"]
    size, patch, hidden = cfg.vision.image_size, cfg.vision.patch_size, cfg.text.hidden_size

    def onehots(scene) -> np.ndarray:  # [P, 15]
        labels = tower.patch_labels(scene, size, patch)
        on_object = (labels["colour"] > 0)[:, None]
        parts = [np.eye(5)[labels["colour"]], np.eye(3)[labels["shape"]] * on_object,
                 np.eye(2)[labels["side"]] * on_object, np.eye(2)[labels["half"]] * on_object,
                 np.eye(scenes.MAX_OBJECTS)[labels["count"]]]
        return np.concatenate(parts, -1).astype(np.float32)

    def batch_of(items) -> dict:  # [(scene, conversation)] -> arrays, with the labels
        made = encoder.batch([c for _, c in items], [scenes.render(s, size) for s, _ in items], LENGTH, TARGETS)
        arrays = {k: jnp.asarray(v) for k, v in vars(made).items() if k != "pixel_values"}
        return {**arrays, "labels": jnp.asarray(np.stack([onehots(s) for s, _ in items]))}

    def embedded(oracle, text, batch):
        is_image = batch["ids"] == cfg.image_token_id
        x = llama.embed_tokens(text, jnp.where(is_image, 0, batch["ids"]))
        tokens = jax.nn.gelu(batch["labels"] @ oracle["a"] + oracle["pos"], approximate=False) @ oracle["b"] + oracle["c"]
        return llava.place_features(x, is_image, tokens), is_image

    def adapted_forward(adapter, text, x, valid, is_image):  # llama.forward + the image-position weights
        t = cfg.text
        no_bias = dataclasses.replace(t, qkv_bias=False)
        cos, sin = llama.rope_tables(t, jnp.broadcast_to(jnp.arange(x.shape[1]), valid.shape), x.dtype)
        branches = [lambda lp=lp: lp for lp in text["layers"]]
        at_image = is_image[:, None, :, None].astype(x.dtype)  # [B, 1, L, 1]

        def layer(h, inputs):  # h [B, L, H]
            index, a = inputs
            lp = jax.lax.switch(index, branches)
            q, k, v = llama.project_qkv(t, lp, h, cos, sin)
            update = {"attn_norm": lp["attn_norm"],  # rank R, on the same normed input, without the layer's bias
                      "w_qkv": (a["qkv_a"] @ a["qkv_b"]).T.reshape(lp["w_qkv"].shape)}
            dq, dk, dv = llama.project_qkv(no_bias, update, h, cos, sin)  # RoPE is linear: rope(q + dq) = q + rope(dq)
            attn, _ = llama.causal_attention(q + at_image * dq, k + at_image * dk, v + at_image * dv, valid)
            h = llama.finish_layer(t, lp, h, attn)
            mlp = jax.nn.silu(rms_norm(h, lp["mlp_norm"], t.rms_norm_eps) @ a["mlp_a"]) @ a["mlp_b"]
            return h + at_image[:, 0] * mlp, None

        h, _ = jax.lax.scan(layer, x, (jnp.arange(len(branches)), adapter))
        return llama.final_hidden(t, text, h)

    def metrics(oracle, text, batch):  # the decoder's weights are an argument: closed over, XLA would fold them
        x, is_image = embedded(oracle, text, batch)
        forward = (functools.partial(adapted_forward, oracle["adapter"], text, is_image=is_image)
                   if "adapter" in oracle else None)
        return vision.embedded_answer_metrics(cfg.text, text, x, is_image, batch, forward)

    config = vision.TrainConfig(steps=args.steps, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps)
    tx = vision.optimizer(config)

    @jax.jit
    def step(oracle, opt_state, text, batch):
        def loss(o):
            answer, m = metrics(o, text, batch)
            return answer + config.image_norm_weight * m["image_norm"], (answer, m)

        (_, (answer, m)), grads = jax.value_and_grad(loss, has_aux=True)(oracle)
        updates, opt_state = tx.update(grads, opt_state, oracle)
        return optax.apply_updates(oracle, updates), opt_state, answer, m["accuracy"]

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    oracle = {"a": jax.random.normal(keys[0], (15, hidden)) * 0.3,
              "pos": jax.random.normal(keys[1], (cfg.image_seq_length, hidden)) * 0.02,
              "b": jax.random.normal(keys[2], (hidden, hidden)) / np.sqrt(hidden), "c": jnp.zeros(hidden)}
    if args.init:
        loaded = {k: jnp.asarray(v) for k, v in np.load(args.init).items()}
        oracle = {k: v for k, v in loaded.items() if not k.startswith("adapter.")}
        if len(oracle) < len(loaded):
            oracle["adapter"] = {k.removeprefix("adapter."): v for k, v in loaded.items() if k.startswith("adapter.")}
            ranks = (oracle["adapter"]["qkv_a"].shape[-1], oracle["adapter"]["mlp_a"].shape[-1])
            if args.adapter_rank and (args.adapter_rank, args.adapter_mlp_rank) != ranks:
                parser.error(f"--init {args.init} holds adapters of ranks {ranks}, not "
                             f"({args.adapter_rank}, {args.adapter_mlp_rank})")
    if args.adapter_rank and "adapter" not in oracle:
        n_layers, qkv_out = len(text["layers"]), int(np.prod(text["layers"][0]["w_qkv"].shape[:3]))
        keys = jax.random.split(jax.random.PRNGKey(1), 2)
        oracle["adapter"] = {  # stacked over the layers; the b's zero, so step 1 runs the plain decoder
            "qkv_a": jax.random.normal(keys[0], (n_layers, hidden, args.adapter_rank)) / np.sqrt(hidden),
            "qkv_b": jnp.zeros((n_layers, args.adapter_rank, qkv_out)),
            "mlp_a": jax.random.normal(keys[1], (n_layers, hidden, args.adapter_mlp_rank)) / np.sqrt(hidden),
            "mlp_b": jnp.zeros((n_layers, args.adapter_mlp_rank, hidden))}
    opt_state = tx.init(oracle)
    held_out = {name: scene_eval.held_out_questions(split, n, seed) for name, split, n, seed in EVALUATIONS}
    evaluate = jax.jit(lambda o, t, b: metrics(o, t, b)[1]["accuracy"])

    def accuracy(items) -> dict:  # per question kind: the held-out split cycles the kinds
        kinds = {}
        for q_kind in dict.fromkeys(q.kind for _, q in items):
            chosen = [(s, [("<image>\n" + q.text, scenes.answer_text(q.answer))]) for s, q in items if q.kind == q_kind]
            kinds[q_kind] = (float(evaluate(oracle, text, batch_of(chosen))), len(chosen))
        total = sum(a * n for a, n in kinds.values()) / len(items)
        return {"all": round(total, 3), **{k: round(a, 3) for k, (a, _) in kinds.items()}}

    curve, losses, start = [], [], time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="oracle", unit="step")
    for s in bar:
        first = args.first_sample + (s - 1) * BATCH
        samples = [scenes.single_picture_sample("train", DATA_SEED, i, 1) for i in range(first, first + BATCH)]
        batch = batch_of([(x.scene, single_picture_conversation(x)) for x in samples])
        oracle, opt_state, loss, train_accuracy = step(oracle, opt_state, text, batch)
        losses.append((float(loss), float(train_accuracy)))
        bar.set_postfix(loss=f"{losses[-1][0]:.3f}")
        if s % args.eval_every == 0 or s == args.steps:
            window = np.mean(losses[-args.eval_every:], axis=0)
            point = {"step": s, "seconds": round(time.perf_counter() - start), "train_loss": round(float(window[0]), 3),
                     "train_accuracy": round(float(window[1]), 3),
                     **{name: accuracy(items) for name, items in held_out.items()}}
            curve.append(point)
            bar.write(json.dumps(point))
            if args.save:
                saved = jax.device_get(oracle)
                np.savez(args.save, **{k: v for k, v in saved.items() if k != "adapter"},
                         **{f"adapter.{k}": v for k, v in saved.get("adapter", {}).items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "curve": curve}, f, indent=1)


if __name__ == "__main__":
    main()

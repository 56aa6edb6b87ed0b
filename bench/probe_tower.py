"""What the demo's vision tower features say, read by linear probes (no decoder).

    python bench/probe_tower.py [--weights PATH | --init] [--train 1024] [--heldout 256] [--json PATH]

Fits one linear probe per stage-0 target (`lookm_jax.train.tower.TARGETS`: colour, shape, side, half,
count) on the frozen last-layer patch features of `--train` training scenes, and prints its accuracy
on `--heldout` held-out scenes, over the patches the target covers (object patches for shape, side and
half), next to the majority-class rate. The weights are the shipped ones unless `--weights` names a
`demo_vision.safetensors` (e.g. an export of a run) or `--init` asks for the seeded tower.
"""

from __future__ import annotations

import argparse
import json

from bench_args import at_least, json_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--weights", metavar="PATH", help="a demo_vision.safetensors (default: the shipped one)")
    source.add_argument("--init", action="store_true", help="the seeded, untrained tower")
    parser.add_argument("--train", type=at_least(1), default=1024, help="training scenes the probes are fitted on")
    parser.add_argument("--heldout", type=at_least(1), default=256, help="held-out scenes they are read on")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write the figures to PATH")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from lookm_jax import loading
    from lookm_jax.train import tower
    from lookm_jax.train.data import Encoder

    model = loading.demo_model(vision="init")
    cfg = model.config.vision
    weights = model.params["vision"] if args.init else loading.read_demo_vision(args.weights or loading.DEMO_VISION_WEIGHTS)["vision"]
    features_of = jax.jit(lambda pixels: tower.patch_features(cfg, weights, pixels))
    preprocess = Encoder.of(model).pixels

    def split(name: str, n: int, first: int) -> tuple[np.ndarray, dict]:
        """-> patch features [n * P, Hv], labels {target: [n * P]}."""
        data = tower.labelled_scenes(cfg, preprocess, name, 0, first, n)
        pixels = data.pop("pixels")
        features = np.concatenate([np.asarray(features_of(jnp.asarray(pixels[i:i + 128]))) for i in range(0, n, 128)])
        return features.reshape(-1, features.shape[-1]), {t: labels.reshape(-1) for t, labels in data.items()}

    x_train, y_train = split("train", args.train, tower.TRAIN_FIRST_INDEX)  # the stage-0 training stream
    x_test, y_test = split("heldout", args.heldout, 0)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    results = {}
    for target, (classes, over, _) in tower.TARGETS.items():
        covered = tower.covered_patches(y_train["colour"], over)
        x, y = jnp.asarray(x_train[covered]), jnp.asarray(y_train[target][covered])
        probe = {"w": jnp.zeros((x.shape[1], classes)), "b": jnp.zeros(classes)}
        opt = optax.adam(1e-2)

        @jax.jit
        def update(probe, state):
            loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y).mean()
            updates, state = opt.update(jax.grad(loss)(probe), state)
            return optax.apply_updates(probe, updates), state

        state = opt.init(probe)
        for _ in range(500):
            probe, state = update(probe, state)
        test = tower.covered_patches(y_test["colour"], over)
        predicted = np.asarray(jnp.asarray(x_test[test]) @ probe["w"] + probe["b"]).argmax(-1)
        truth = y_test[target][test]
        results[target] = {"accuracy": float((predicted == truth).mean()),
                           "majority": float(np.bincount(truth).max() / len(truth)), "patches": int(test.sum())}
    label = "seeded tower" if args.init else (args.weights or "shipped weights")
    print(f"linear probes on {label}: {args.train} training / {args.heldout} held-out scenes")
    print(f"{'target':8} {'patches':>8} {'accuracy':>9} {'majority':>9}")
    for target, r in results.items():
        print(f"{target:8} {r['patches']:8d} {r['accuracy']:9.3f} {r['majority']:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"weights": label, "train": args.train, "heldout": args.heldout, "targets": results}, f, indent=1)


if __name__ == "__main__":
    main()

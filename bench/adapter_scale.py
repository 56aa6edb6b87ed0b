"""How hard the demo's stage-2 adapters are driven: the shipped adapters folded at a fraction of their
strength (b x F), or on some of their weights or layers only, against what the demo then knows.

    python bench/adapter_scale.py --scales 1 0.85 0.75 0.5                 # every adapter scaled
    python bench/adapter_scale.py --scales 1 --parts attention             # attention adapters only
    python bench/adapter_scale.py --scales 0.6 0.5 0.4 --held-out-text 0 --generated 150 --single 0
    python bench/adapter_scale.py --scales 0.85 --save CANDIDATES          # then `lookm eval scenes calibrate --model`

Prints, per candidate, side by side: text agreement with the frozen decoder (the share of the first 32
greedy tokens equal, `train.replay`) on the held-out replay prompts that `bench/demo_report.py`
reports, and on prompts the frozen decoder writes itself (`replay.generated_prompts`, seed
--generated-seed: none of the reported prompts, so a scale can be chosen on them); and held-out
single-picture accuracy over scenes of trained colour-shape pairs (`eval.scenes.single_picture_accuracy`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench_args import at_least, json_path

from lookm_jax.models import llama

_ATTENTION = ("w_qkv", "wo")
PARTS = {"all": llama.ADAPTED_WEIGHTS, "attention": _ATTENTION,
         "mlp": tuple(w for w in llama.ADAPTED_WEIGHTS if w not in _ATTENTION)}


def scaled_adapters(flat: dict, factor: float, weights: tuple[str, ...], layers: range | None) -> dict:
    """Exported adapters ("layers.{i}.{weight}.a" / ".b") with b x factor on `weights` of `layers` (all
    layers when None) and b = 0 elsewhere: the folded decoder adds factor x b @ a there, nothing elsewhere."""
    import numpy as np

    out = {}
    for name, value in flat.items():
        _, layer, weight, part = name.split(".")
        kept = weight in weights and (layers is None or int(layer) in layers)
        out[name] = value.astype(np.float32) * np.float32(factor if kept else 0.0) if part == "b" else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", type=float, nargs="+", required=True, help="factors F on the adapters' b, > 0")
    parser.add_argument("--parts", choices=tuple(PARTS), default="all", help="which adapted weights keep their adapters")
    parser.add_argument("--layers", type=at_least(0), nargs=2, metavar=("FIRST", "LAST"),
                        help="keep the adapters of these layers only (default: every layer)")
    parser.add_argument("--held-out-text", type=at_least(0), default=1, help="1: text agreement on the held-out prompts")
    parser.add_argument("--generated", type=at_least(0), default=0, help="self-written prompts to measure text on (0: none)")
    parser.add_argument("--generated-seed", type=at_least(0), default=1000, help="seed of the self-written prompts")
    parser.add_argument("--single", type=at_least(0), default=200, help="held-out single-picture questions (trained pairs)")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the held-out splits")
    parser.add_argument("--save", help="write each candidate model into this folder (one subfolder each)")
    parser.add_argument("--json", type=json_path, help="also write the rows here")
    args = parser.parse_args()
    if not all(0 < s < float("inf") for s in args.scales):
        parser.error(f"--scales must be finite numbers > 0, got {args.scales}")
    if args.layers and args.layers[0] > args.layers[1]:
        parser.error(f"--layers needs FIRST <= LAST, got {args.layers}")

    from safetensors.numpy import load_file, save_file

    from lookm_jax import loading
    from lookm_jax.eval import scenes as bench
    from lookm_jax.train import replay

    flat = load_file(loading.DEMO_ADAPTERS_WEIGHTS)
    tokens = {"adapted_tokens": loading.demo_adapters_tokens(loading.DEMO_ADAPTERS_WEIGHTS)}  # folded, or on images
    layers = None if not args.layers else range(args.layers[0], args.layers[1] + 1)
    frozen = loading.demo_model(vision="trained", decoder="frozen")
    text_sets = {}
    if args.held_out_text:
        text_sets["held_out"] = replay.prompts("heldout", args.seed)
    if args.generated:
        text_sets["generated"] = replay.generated_prompts(frozen, args.generated, args.generated_seed, progress=True)
    ids = {name: [frozen.encode_chat(p) for p in prompts] for name, prompts in text_sets.items()}
    reference = {name: replay.greedy_continuations(frozen, rows) for name, rows in ids.items()}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for factor in args.scales:
            label = f"{factor:g}x {args.parts}" + (f" layers {args.layers[0]}-{args.layers[1]}" if layers else "")
            path = os.path.join(scratch, "adapters.safetensors")
            save_file(scaled_adapters(flat, factor, PARTS[args.parts], layers), path, metadata=tokens)
            model = loading.demo_model(vision="trained", decoder=path)
            row = {"candidate": label, "scale": factor, "parts": args.parts, "layers": args.layers}
            for name, rows_ids in ids.items():
                row[f"text_{name}"] = replay.agreement(reference[name], replay.greedy_continuations(model, rows_ids))
            if args.single:
                single = bench.single_picture_accuracy(model, "heldout", args.single, args.seed, pairs="trained")
                row["single_trained"], row["single_by_kind"] = single["accuracy"], single["by_kind"]
            if args.save:
                row["saved"] = os.path.join(args.save, label.replace(" ", "_"))
                model.save(row["saved"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    columns = [c for c in ("text_held_out", "text_generated", "single_trained") if c in rows[0]]
    print("\n| candidate | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['candidate']} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "text_prompts": {k: len(v) for k, v in text_sets.items()},
                       "single": args.single, "seed": args.seed}, f, indent=1)


if __name__ == "__main__":
    main()

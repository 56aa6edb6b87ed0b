"""`lookm train decoder`: LLaVA stage 2 on the demo (adapters on the SmolLM2 decoder + the projector)."""

from __future__ import annotations

import argparse
import json
import os

from lookm_jax import scenes
from lookm_jax.checks import check_output_folder
from lookm_jax.cli_args import finite_float, int_at_least, path_arg, positive_float, seed_arg
from lookm_jax.train.adapters import ADAPTED_TOKENS



def kind_weight(text: str) -> tuple[str, int]:
    """argparse type of --kind-weight: "KIND=N" -> (KIND, N), N a whole number >= 1."""
    kind, _, weight = text.partition("=")
    if not weight.isdigit() or int(weight) < 1:
        raise argparse.ArgumentTypeError(f"expected KIND=N with N a whole number >= 1, got {text!r}")
    return kind, int(weight)


def layer_range(text: str) -> tuple[int, ...]:
    """argparse type of --read-layers: "19-26" or "3,5,8" -> the layer indices (>= 0, distinct)."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-"))
            layers = tuple(range(first, last + 1))
        else:
            layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        layers = ()
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST or a comma-separated list of distinct layers >= 0, got {text!r}")
    return layers


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "decoder",
        help="train the demo's decoder (low-rank adapters) and projector on multi-picture conversations (stage 2)",
        description="LLaVA's stage 2 on the demo: LoRA adapters on every SmolLM2 layer and the projector learn "
                    "answers about 1-16 pictures, with the frozen decoder's own continuations of text prompts replayed "
                    "every step. The tower stays as shipped. Resumes from OUTPUT's checkpoint; writes "
                    "demo_adapters.safetensors and demo_vision.safetensors (tower + trained projector) at the end.")
    p.add_argument("--output", type=path_arg, required=True, help="run folder: checkpoint, log.jsonl, replay banks, "
                   "exported weights (required)")
    p.add_argument("--steps", type=int_at_least(2), default=600, help="steps (the cosine schedule's length)")
    p.add_argument("--rank", type=int_at_least(1), default=16, help="adapter rank")
    p.add_argument("--scale", type=positive_float, default=2.0, help="adapter scale (LoRA's alpha / rank)")
    p.add_argument("--learning-rate", type=finite_float, default=3e-4,
                   help="the adapters' peak AdamW rate, >= 0 (0 keeps the --init adapters: only the projector trains, "
                        "and text-only answers stay exactly the init's)")
    p.add_argument("--projector-learning-rate", type=finite_float, default=1e-4,
                   help="the projector's peak rate, >= 0 (0 keeps the shipped projector)")
    p.add_argument("--warmup-steps", type=int_at_least(0), default=30, help="linear warmup steps")
    p.add_argument("--replay-batch-size", type=int_at_least(1), default=4, help="text-only replay prompts per step")
    p.add_argument("--replay-weight", type=finite_float,
                   help="weight of the replay KL to the frozen decoder, >= 0 (default 1; 0 with --adapted-tokens image)")
    p.add_argument("--replay-generated", type=int_at_least(0), default=0,
                   help="text prompts the frozen decoder writes itself (its chat template opened for a user turn, "
                        "sampled), answered by it and added to the replay's templated prompts (0: templates only)")
    p.add_argument("--read-weight", type=finite_float, default=0.0,
                   help="weight of the read loss, >= 0: the attention from each answer onto the patches of what it "
                        "is about, in --read-layers (0: off)")
    p.add_argument("--read-layers", type=layer_range, default=(), metavar="FIRST-LAST",
                   help="the decoder layers the read loss supervises, e.g. 19-26 or 20,22,24")
    p.add_argument("--subspace-dims", type=int_at_least(0), default=0,
                   help="each adapter reads only this many directions of its input: those picture conversations use "
                        "and text-only prompts do not, so text keeps the frozen decoder's behaviour (0: every direction)")
    p.add_argument("--adapted-tokens", choices=ADAPTED_TOKENS, default=ADAPTED_TOKENS[0],
                   help="which tokens the adapters update: all, or the image tokens only (partial LoRA: text tokens "
                        "and every text-only prompt run the frozen decoder exactly, so no replay is needed; the demo "
                        "then applies them in the prefill instead of folding them)")
    p.add_argument("--eval-every", type=int_at_least(1), default=100, help="steps between held-out accuracy checks")
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=10, help="steps between checkpoints")
    p.add_argument("--init", type=path_arg, help="start from a finished run's folder (its exported adapters and "
                   "projector), or 'shipped' for the demo's own; fresh optimizer and schedule (default: fresh adapters)")
    p.add_argument("--init-scale", type=positive_float, default=1.0,
                   help="scale the --init adapters by this at the start (b x F; default 1: as exported)")
    p.add_argument("--kind-weight", type=kind_weight, action="append", default=[], metavar="KIND=N",
                   help="draw multi-picture question KIND N times as often as the others (repeatable; kinds: "
                        "picture_colour picture_shape which_picture count_pictures picture_position describe)")
    p.add_argument("--count-answers", choices=scenes.COUNT_FORMS, default=scenes.COUNT_FORMS[0],
                   help="how 'how many pictures show a SHAPE' is answered: word, the count alone ('Three.'); listed, "
                        "the pictures first ('2,5,7: three.'); tallied, every picture's shape in turn with a running "
                        "count in words ('1 square (one), 2 circle (one), 3 square (two): two.')")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the data streams and the adapters' init")
    p.add_argument("--stop-after", type=int_at_least(0),
                   help="end this call after N steps, resumable; 0 exports OUTPUT's checkpoint (default: run to --steps)")
    p.set_defaults(func=cmd_decoder)


def decoder_config(args):
    """The parsed flags -> a `DecoderConfig`; a bad value raises ValueError naming its flag."""
    from lookm_jax.train import decoder

    if args.warmup_steps >= args.steps:
        raise ValueError(f"--warmup-steps must be < --steps, got {args.warmup_steps} and {args.steps}")
    if args.read_weight > 0 and not args.read_layers:
        raise ValueError("--read-weight > 0 needs --read-layers (e.g. 19-26)")
    if args.init not in (None, decoder.SHIPPED) and not os.path.isdir(args.init):
        raise ValueError(f"--init must be a finished run's folder or '{decoder.SHIPPED}', got {args.init} (no such folder)")
    if args.init is None and args.init_scale != 1:
        raise ValueError(f"--init-scale scales the --init adapters, and no --init was given (got {args.init_scale})")
    image_only = args.adapted_tokens == "image"
    if image_only and (args.replay_weight or args.replay_generated):
        raise ValueError("--adapted-tokens image leaves text-only prompts to the frozen decoder exactly: no replay, so "
                         f"--replay-weight and --replay-generated must be 0 or left out, got {args.replay_weight} and "
                         f"{args.replay_generated}")
    if args.replay_weight is None:
        args.replay_weight = 0.0 if image_only else 1.0
    for flag in ("learning_rate", "projector_learning_rate", "replay_weight", "read_weight"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.learning_rate == 0 == args.projector_learning_rate:
        raise ValueError("--learning-rate and --projector-learning-rate are both 0: nothing would train")
    batches = decoder.weighted_batches(dict(args.kind_weight))
    if args.count_answers != scenes.COUNT_FORMS[0]:
        batches = decoder.with_count_form(args.count_answers, batches)
    return decoder.DecoderConfig(
        steps=args.steps, rank=args.rank, scale=args.scale, learning_rate=args.learning_rate,
        projector_learning_rate=args.projector_learning_rate, warmup_steps=args.warmup_steps, seed=args.seed,
        replay_batch_size=args.replay_batch_size, replay_weight=args.replay_weight,
        replay_generated=args.replay_generated, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, init=args.init, init_scale=args.init_scale, read_weight=args.read_weight,
        read_layers=args.read_layers, subspace_dims=args.subspace_dims, adapted_tokens=args.adapted_tokens,
        batches=batches)


def cmd_decoder(args) -> int:
    import dataclasses

    from lookm_jax import loading
    from lookm_jax.train import decoder, runs, vision

    config = decoder_config(args)
    check_output_folder(args.output, "--output")  # a new run's folder, or a run's to resume it
    if args.stop_after == 0 and not os.path.isfile(os.path.join(args.output, runs.CHECKPOINT)):
        raise ValueError(f"--stop-after 0 exports the run's checkpoint, and {args.output} has none")
    model = loading.demo_model(vision="trained", decoder="frozen")  # stage 2 starts from the frozen decoder
    trained = decoder.train(model, config, args.output, stop_after=args.stop_after)
    metadata = {"train_config": json.dumps(dataclasses.asdict(config), default=str),
                "adapted_tokens": config.adapted_tokens}  # `loading.demo_adapters_tokens`
    path = os.path.join(args.output, decoder.ADAPTERS_FILE)
    decoder.export_adapters(path, trained["adapters"], config.scale, metadata)
    vision_path = os.path.join(args.output, decoder.VISION_FILE)
    vision.export_weights(vision_path, {"vision": model.params["vision"], "projector": trained["projector"]},
                          {**metadata, "vision_config": json.dumps(loading.DEMO_VISION)})
    print(f"wrote {path} and {vision_path}")
    return 0

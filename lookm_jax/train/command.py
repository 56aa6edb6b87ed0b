"""`lookm train vision`: align the demo's CLIP tower and projector to the frozen SmolLM2 decoder."""

from __future__ import annotations

import json
import os

from lookm_jax.checks import check_output_folder
from lookm_jax.cli_args import finite_float, int_at_least, path_arg, positive_float, seed_arg

# Stage 0's defaults (tower.PretrainConfig's; a test checks they agree) and the most turns: literals, so that parsing the
# command line does not import jax.
PRETRAIN_STEPS, PRETRAIN_SCENES = 3000, 16384
MAX_TURNS = 3  # train.data.MAX_SINGLE_TURNS (a test checks they agree)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "vision",
        help="train the demo's vision tower + projector on procedural scenes (frozen decoder)",
        description="Stage 0 pretrains the tower on patch labels; stage 1 trains the projector (and, with "
                    "--tower-lr-scale, the tower) on answer tokens through the frozen SmolLM2 decoder. Resumes from OUTPUT's checkpoint.")
    p.add_argument("--steps", type=int_at_least(1), default=400, help="stage-1 steps (the cosine schedule's length)")
    p.add_argument("--output", type=path_arg, required=True, help="run folder: checkpoint, log.jsonl, demo_vision.safetensors (required)")
    p.add_argument("--learning-rate", type=positive_float, default=2e-3, help="stage-1 peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int_at_least(0), default=30, help="stage-1 linear warmup steps")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="single-picture conversations per step")
    p.add_argument("--turns", type=int, default=3,
                   help=f"questions per single-picture conversation, in [1, {MAX_TURNS}] (the first asked with the picture, "
                        "as the held-out benchmark asks it; default 3)")
    p.add_argument("--multi-every", type=int_at_least(0), default=4,
                   help="every N-th step trains on conversations over 2-8 pictures instead (0 = never)")
    p.add_argument("--text-facts", action="store_true",
                   help="one turn of each multi-picture conversation asks about a sentence between the pictures "
                        "instead (default off; the shipped weights were trained with it)")
    p.add_argument("--tower-lr-scale", type=finite_float, default=0.0,
                   help="stage-1 learning rate of the tower as a fraction of the projector's, in [0, 1] "
                        "(default 0: the tower keeps its stage-0 features, as in LLaVA's stage 1)")
    p.add_argument("--anchor-weight", type=finite_float, default=0.0,
                   help="keep stage 0's patch loss in the stage-1 objective at this weight while the tower trains "
                        "(needs --tower-lr-scale > 0; default 0: no anchor)")
    p.add_argument("--pretrain-steps", type=int_at_least(0), default=PRETRAIN_STEPS, help="stage-0 steps (0 = skip stage 0)")
    p.add_argument("--pretrain-scenes", type=int, default=PRETRAIN_SCENES,
                   help="distinct training scenes stage 0 cycles through (at least one stage-0 batch)")
    p.add_argument("--eval-every", type=int_at_least(1), default=50, help="steps between held-out accuracy checks")
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=10, help="steps between checkpoints")
    p.add_argument("--init", metavar="WEIGHTS", type=path_arg,
                   help="start stage 1 from these exported weights (a demo_vision.safetensors; skips stage 0) "
                        "instead of the seeded tower (default: seeded tower)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the scene stream and the stage-0 head")
    p.add_argument("--stop-after", type=int_at_least(0),
                   help="end this call after N steps, resumable; 0 exports OUTPUT's checkpoint (default: run to --steps)")
    p.set_defaults(func=cmd_vision)


def train_config(args):
    """The parsed flags -> a `TrainConfig`; a bad value raises ValueError naming its flag."""
    import dataclasses

    from lookm_jax.train import data, tower, vision

    if args.warmup_steps >= args.steps:
        raise ValueError(f"--warmup-steps must be < --steps, got {args.warmup_steps} and {args.steps}")
    if args.pretrain_scenes < tower.PretrainConfig.batch_size:
        raise ValueError(f"--pretrain-scenes must be >= {tower.PretrainConfig.batch_size} (one stage-0 batch), "
                         f"got {args.pretrain_scenes}")
    if args.text_facts and not args.multi_every:
        raise ValueError("--text-facts needs multi-picture steps: --multi-every must be >= 1, got 0")
    if not 0 <= args.tower_lr_scale <= 1:
        raise ValueError(f"--tower-lr-scale must be in [0, 1], got {args.tower_lr_scale}")
    if args.anchor_weight < 0 or (args.anchor_weight > 0 and args.tower_lr_scale == 0):
        raise ValueError(f"--anchor-weight must be >= 0, and > 0 only with --tower-lr-scale > 0, got "
                         f"{args.anchor_weight} with --tower-lr-scale {args.tower_lr_scale}")
    try:
        single = data.single_picture_spec(args.batch_size, args.turns)
    except ValueError as e:  # "turns must be in ..."
        raise ValueError(f"--{e}") from None
    defaults = vision.TrainConfig()
    return vision.TrainConfig(
        steps=args.steps, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed,
        single=single,
        multi=dataclasses.replace(defaults.multi, text_facts=args.text_facts) if args.multi_every else None,
        multi_every=max(args.multi_every, 1),
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        tower_learning_rate_scale=args.tower_lr_scale, anchor_weight=args.anchor_weight,
        pretrain=tower.PretrainConfig(steps=args.pretrain_steps, dataset=args.pretrain_scenes, seed=args.seed)
        if args.pretrain_steps and not args.init else None)


def cmd_vision(args) -> int:
    import dataclasses

    import jax

    from lookm_jax import loading
    from lookm_jax.train import vision

    config = train_config(args)
    check_output_folder(args.output, "--output")  # a new run's folder, or a run's to resume it
    if args.stop_after == 0 and not os.path.isfile(os.path.join(args.output, vision.CHECKPOINT)):
        raise ValueError(f"--stop-after 0 exports the run's checkpoint, and {args.output} has none")
    start = None
    if args.init:
        if os.path.isdir(args.init):
            raise ValueError(f"--init {args.init} is a folder; give the demo_vision.safetensors a run exported")
        if not os.path.isfile(args.init):
            raise FileNotFoundError(f"--init: no such weights file: {args.init}")
        start = loading.read_demo_vision(args.init)
    model = loading.demo_model(vision="init")
    if start is not None:
        shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)  # noqa: E731
        if shapes(start) != shapes({k: model.params[k] for k in vision.TRAINABLE}):
            raise ValueError(f"--init {args.init}: not the demo's vision weights (the tensors and shapes "
                             "that `lookm train vision` exports)")
    trainable = vision.train(model, config, args.output, trainable=start, stop_after=args.stop_after)
    path = os.path.join(args.output, "demo_vision.safetensors")
    vision.export_weights(path, trainable, {"train_config": json.dumps(dataclasses.asdict(config)),
                                            "vision_config": json.dumps(loading.DEMO_VISION)})
    print(f"wrote {path}")
    return 0

"""The `lookm` command. `lookm generate` with no arguments runs the embedded offline demo."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

DEFAULT_PROMPT = "Write a haiku about the sea."
ASSETS = os.path.join(os.path.dirname(__file__), "assets")
DEFAULT_IMAGES = [os.path.join(ASSETS, "landscape.png"), os.path.join(ASSETS, "apple.png")]


# Command groups: `lookm eval NAME ...`, `lookm plot NAME ...`. Each module listed defines
# `add_parser(subparsers)`, adding its command with `set_defaults(func=...)`; modules keep heavy
# imports (jax, matplotlib) inside their command functions so `lookm --help` stays fast.
GROUP_HELP = {"eval": "evaluate methods on a benchmark", "plot": "draw figures", "train": "train models"}
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "eval": ("lookm_jax.eval.milebench", "lookm_jax.eval.needle"),
    "plot": ("lookm_jax.plots",),
    "train": ("lookm_jax.train.command",),
}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """--method/--budget/--alpha-recent/--alpha-important/--merge, read back by `_method_from_args`."""
    parser.add_argument("--method", default="full", help="KV-cache method (see lookm_jax.METHODS)")
    parser.add_argument("--budget", type=float, help="kept fraction of the prompt, split evenly recent/important")
    parser.add_argument("--alpha-recent", type=float)
    parser.add_argument("--alpha-important", type=float)
    parser.add_argument("--merge", choices=("none", "averaged", "pivotal", "weighted"))


def _method_from_args(args):
    from lookm_jax.methods import get_method

    if args.method == "full":
        return get_method("full")
    kwargs = {}
    if args.budget is not None:
        kwargs["budget"] = args.budget
    if args.alpha_recent is not None:
        kwargs["alpha_recent"] = args.alpha_recent
    if args.alpha_important is not None:
        kwargs["alpha_important"] = args.alpha_important
    if args.merge is not None:
        kwargs["merge"] = None if args.merge == "none" else args.merge
    return get_method(args.method, **kwargs)


def cmd_generate(args) -> int:
    import jax.numpy as jnp

    import lookm_jax

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    model = lookm_jax.load(args.model, dtype) if args.model else lookm_jax.load_default(dtype)
    if model.manifest.get("vision_untrained"):
        print("note: the default demo model pairs the real SmolLM2-135M-Instruct decoder with an UNTRAINED, "
              "seeded CLIP tower and projector: image tokens are noise to it. Answers are about the text.")
    images = args.image if args.image is not None else (DEFAULT_IMAGES if model.is_multimodal and not args.model else [])
    if args.text_only:
        images = []
    pixel_values, tiles = model.preprocess_images(images) if images else (None, None)
    input_ids = model.encode_chat(args.prompt, num_images=len(images), image_tiles=tiles)
    result = model.run(input_ids, pixel_values, max_new_tokens=args.max_new_tokens, method=_method_from_args(args),
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    answer = model.decode_text(result.tokens[0][: int(result.lengths[0])])
    n_prompt, n_image = int(result.prompt_lengths[0]), int(result.image_tokens[0])
    print(f"prompt: {args.prompt!r} with {len(images)} image(s)")
    print(f"answer: {answer}")
    print(f"prompt tokens: {n_prompt} ({n_image} image, {n_prompt - n_image} text), bucket {result.bucket}; "
          f"generated {int(result.lengths[0])}")
    print(f"method: {args.method}; kept prompt tokens per layer and KV head: {result.kept_image_tokens[0]:.1f} image, "
          f"{result.kept_text_tokens[0]:.1f} text")
    print(f"KV cache: {_mib(result.cache_bytes)} after compression, {_mib(result.full_cache_bytes)} full "
          f"({result.cache_bytes / result.full_cache_bytes:.1%})")
    print(f"compile {result.compile_seconds:.2f} s; prefill {result.prefill_seconds:.3f} s; "
          f"decode {result.decode_ms_per_token:.1f} ms/token")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text (no arguments: the embedded offline demo)")
    g.add_argument("--model", help="HF llava/llama checkpoint folder, converted folder, or .gguf file "
                                   "(default: the embedded SmolLM2 demo model)")
    g.add_argument("--image", action="append", help="image file (repeatable); default: two bundled pictures")
    g.add_argument("--text-only", action="store_true", help="no images, even on the demo model")
    g.add_argument("--prompt", default=DEFAULT_PROMPT)
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_method_arguments(g)
    g.set_defaults(func=cmd_generate)
    for group, help_text in GROUP_HELP.items():
        commands = sub.add_parser(group, help=help_text).add_subparsers(dest=f"{group}_command", required=True)
        for module in COMMAND_MODULES[group]:
            importlib.import_module(module).add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"lookm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `lookm` command. `lookm generate` with no arguments runs the embedded offline demo.

Every refused input ends the command with one line on stderr, `lookm: error: ...`, and exit
status 2 (argument errors included); set LOOKM_TRACEBACK=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lookm_jax import chat_cli
from lookm_jax.cli_args import (DEFAULT_PROMPT, DEFAULT_TEXT_PROMPT, HelpFormatter, add_method_arguments,
                                add_prompt_arguments, check_image_markers, default_images, int_at_least,
                                method_from_args, path_arg, read_prompt)
from lookm_jax.errors import PARAM_DTYPES, InputError

# Command groups: `lookm eval NAME ...`, `lookm plot NAME ...`. Each module listed defines
# `add_parser(subparsers)`, adding its command with `set_defaults(func=...)`; modules keep heavy
# imports (jax, matplotlib) inside their command functions so `lookm --help` stays fast.
GROUP_HELP = {"eval": "evaluate methods on a benchmark", "plot": "draw figures", "train": "train models"}
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "eval": ("lookm_jax.eval.milebench", "lookm_jax.eval.needle", "lookm_jax.eval.scenes"),
    "plot": ("lookm_jax.plots",),
    "train": ("lookm_jax.train.command", "lookm_jax.train.decoder_command"),
}


class Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: help shows each option's default; errors are one line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        print(f"lookm: error: {self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _add_buckets(model, extra: list[int] | None) -> None:
    """Add --buckets' prompt lengths to the model's bucket table."""
    if not extra:
        return
    model.buckets = tuple(sorted(set(model.buckets) | set(extra)))


def cmd_generate(args) -> int:
    import lookm_jax
    from lookm_jax import generate as gen

    from lookm_jax.inputs import open_image

    method = method_from_args(args)  # bad options, prompt files and images are refused before the model loads
    gen.Sampling(args.temperature, args.top_p)  # validates them
    if args.text_only and args.image:
        raise InputError("--text-only asks for no images; drop --image or --text-only")
    prompt = read_prompt(args)
    images = [] if args.text_only else [open_image(path) for path in default_images(args)]
    if not images and not args.prompt_file and args.prompt == DEFAULT_PROMPT:
        prompt = DEFAULT_TEXT_PROMPT
    check_image_markers(prompt, len(images))
    if args.question_after_compression:
        chat_cli.split_question(prompt, len(images))  # refused before the model loads
    model = lookm_jax.load(args.model, args.dtype) if args.model else lookm_jax.load_default(args.dtype)
    _add_buckets(model, args.buckets)
    if not args.model:
        print(f"note: the demo model's decoder is {model.manifest['decoder']}; {model.manifest['vision']}")
    if args.question_after_compression:
        return _generate_after_compression(args, model, prompt, images)
    pixel_values, tiles = model.preprocess_images(images) if images else (None, None)
    input_ids = model.encode_chat(prompt, num_images=len(images), image_tiles=tiles)
    result = model.run(input_ids, pixel_values, max_new_tokens=args.max_new_tokens, method=method,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       ignore_context_limit=args.ignore_context_limit)
    answer = model.decode_text(result.tokens[0][: int(result.lengths[0])])
    n_prompt, n_image = int(result.prompt_lengths[0]), int(result.image_tokens[0])
    shown = prompt if len(prompt) <= 200 else f"{prompt[:200]}... ({len(prompt)} characters)"
    print(f"prompt: {shown!r} with {len(images)} image(s)")
    print(f"answer: {answer}")
    print(f"prompt tokens: {n_prompt} ({n_image} image, {n_prompt - n_image} text), bucket {result.bucket}; "
          f"generated {int(result.lengths[0])}")
    print(f"method: {args.method}; kept prompt tokens per layer and KV head: {result.kept_image_tokens[0]:.1f} image, "
          f"{result.kept_text_tokens[0]:.1f} text")
    print(f"KV cache: {_mib(result.cache_bytes)} after compression, {_mib(result.full_cache_bytes)} full: "
          f"{result.cache_bytes / result.full_cache_bytes:.1%}, counting slots per layer and KV head "
          f"({result.prompt_slots} kept prompt + {result.new_slots} new-token slots, of "
          f"{result.bucket} bucket + {result.new_slots} new-token slots)")
    print(f"compile {result.compile_seconds:.2f} s; prefill {result.prefill_seconds:.3f} s; "
          f"decode {result.decode_ms_per_token:.1f} ms/token")
    return 0


def _generate_after_compression(args, model, prompt: str, images: list) -> int:
    """`lookm generate --question-after-compression`: the prompt's last line asked after the rest
    (pictures and lines before it) is encoded and compressed."""
    context, question = chat_cli.split_question(prompt, len(images))
    conversation = chat_cli.start(args, model, context, images)
    answer, result = conversation.ask(question, max_new_tokens=args.max_new_tokens, **chat_cli.sampling_kwargs(args))
    print(f"question after compression: {question!r}, context with {len(images)} image(s)")
    print(f"answer: {answer}")
    print(chat_cli.describe_context(conversation, args.method))
    steps = max(int(result.lengths[0]) - 1, 1)
    print(f"compile {result.compile_seconds:.2f} s; question prefill {result.prefill_seconds:.3f} s "
          f"({int(result.question_tokens[0])} tokens); decode {1e3 * result.decode_seconds / steps:.1f} ms/token")
    return 0


def cmd_methods(args) -> int:
    from lookm_jax.compression.methods import METHODS, ScorerMethod, method_class, parameters

    for name in METHODS:
        cls = method_class(name)
        print(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        for param, default in parameters(name).items():
            print(f"    {param} = {default!r}")
        if issubclass(cls, ScorerMethod):
            share = cls.RECENT_SHARE
            print(f"    (budget=b sets alpha_recent = {share:g} b, alpha_important = {1 - share:g} b; --budget on the "
                  "command line)")
    return 0


def cmd_convert(args) -> int:
    import ml_dtypes
    import numpy as np

    from lookm_jax.convert import store
    from lookm_jax.loading import read_checkpoint

    if store.is_converted(args.src):
        raise InputError(f"{args.src} is already a converted folder")
    if os.path.exists(args.dst) and not args.force:
        raise InputError(f"{args.dst} exists; pass --force to replace it")
    store.check_replaceable(args.dst)
    ckpt = read_checkpoint(args.src)
    dtype = {"checkpoint": None, "float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[args.dtype]
    # atomic (a tmp folder renamed); one tensor in memory at a time
    store.convert_checkpoint(args.dst, ckpt.config, ckpt.tensors, ckpt.manifest, ckpt.tokenizer_json, dtype)
    print(f"converted {args.src} -> {args.dst} (`lookm generate --model {args.dst}`)")
    return 0


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text (no arguments: the embedded offline demo)")
    add_prompt_arguments(g)
    g.add_argument("--text-only", action="store_true", help="no images, even on the demo model")
    g.add_argument("--buckets", type=int_at_least(1), nargs="+",
                   help="extra prompt bucket lengths, added to the table (default: none beyond 64 ... 16384)")
    g.add_argument("--question-after-compression", action="store_true",
                   help="encode and compress the pictures and the prompt's lines before its last, then ask the last "
                        "line (as `lookm chat` asks)")
    chat_cli.add_sampling_arguments(g, max_new_tokens=48)
    add_method_arguments(g)
    g.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lookm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    chat_cli.add_parser(sub)
    sub.add_parser("methods", help="list the compression methods, their parameters and defaults").set_defaults(
        func=cmd_methods)
    c = sub.add_parser("convert", help="convert a checkpoint into a converted folder (fast to load)")
    c.add_argument("src", type=path_arg, help="HF checkpoint folder (llava-hf, original LLaVA layout, llama/qwen2) or .gguf file")
    c.add_argument("dst", type=path_arg, help="converted folder to write (atomically)")
    c.add_argument("--force", action="store_true", help="replace DST if it exists (a converted or empty folder only)")
    c.add_argument("--dtype", choices=("checkpoint", *PARAM_DTYPES), default="checkpoint",
                   help="dtype of the stored parameters ('checkpoint': each keeps its own, so fp16 stays 16-bit)")
    c.set_defaults(func=cmd_convert)
    for group, help_text in GROUP_HELP.items():
        commands = sub.add_parser(group, help=help_text).add_subparsers(dest=f"{group}_command", required=True)
        for module in COMMAND_MODULES[group]:
            importlib.import_module(module).add_parser(commands)
        commands.metavar = "{" + ",".join(commands.choices) + "}"  # argparse names a missing one by it
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # InputError, ConfigError, CheckpointError, missing files
        if os.environ.get("LOOKM_TRACEBACK", "0") not in ("", "0"):
            raise
        print(f"lookm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

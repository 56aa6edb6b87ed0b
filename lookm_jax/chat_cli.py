"""`lookm chat` and `lookm generate --question-after-compression`: questions asked after the
pictures are encoded and compressed once (`lookm_jax.chat.Conversation`).

`lookm chat` reads one question a line (from a terminal with a prompt, else from standard input, so
it is scriptable) and answers each from the one compressed context, extended turn by turn. A bad
question gets one line on stderr, `lookm: error: ...`, and the session keeps its context.
"""

from __future__ import annotations

import argparse
import sys

from lookm_jax.cli_args import (add_method_arguments, check_image_markers, default_images, finite_float,
                                int_at_least, method_from_args, path_arg, seed_arg)
from lookm_jax.errors import PARAM_DTYPES, InputError
from lookm_jax.models.processors import IMAGE_MARKER


def split_question(prompt: str, n_images: int) -> tuple[str, str]:
    """A one-shot prompt -> (context text with an "<image>" marker per picture, question): the
    question is the prompt's last line; the pictures its markers do not place go first."""
    check_image_markers(prompt, n_images)
    context, _, question = prompt.rpartition("\n")
    if IMAGE_MARKER in question:
        raise InputError(f"--question-after-compression asks the prompt's last line after the pictures; it has an "
                         f"{IMAGE_MARKER} marker: put the question on a line of its own")
    context = f"{IMAGE_MARKER}\n" * (n_images - prompt.count(IMAGE_MARKER)) + context + ("\n" if context else "")
    if not context.strip() or not question.strip():
        raise InputError("--question-after-compression needs a context (pictures, or lines before the question) and "
                         "a question on the prompt's last line")
    return context, question


def start(args, model, context_text: str, images: list):
    """The conversation of a command's arguments: its pictures and context encoded and compressed."""
    from lookm_jax.chat import Conversation

    pixel_values, tiles = model.preprocess_images(images) if images else (None, None)
    return Conversation(model, context_text, pixel_values, tiles, method=method_from_args(args),
                        ignore_context_limit=args.ignore_context_limit)


def describe_context(conversation, method: str) -> str:
    """One line: the context's tokens and its compressed cache's size (printed once)."""
    context = conversation.context
    length, bucket = int(context.prompt_lengths[0]), context.bucket
    image_id = conversation.model.config.image_token_id if conversation.model.is_multimodal else None
    image = sum(t == image_id for t in conversation.token_ids[:length])
    cache = context.cache
    kept = cache.nbytes / cache.slot_bytes  # mean slots per layer (a per-layer split keeps different numbers)
    return (f"context: {length} tokens ({image} image, {length - image} text), bucket {bucket}; method "
            f"{method}: KV cache {cache.nbytes / 2**20:.2f} MiB after compression, "
            f"{cache.slot_bytes * bucket / 2**20:.2f} MiB full ({kept:g} of {bucket} slots per layer and KV head kept)")


def sampling_kwargs(args) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}


def cmd_chat(args) -> int:
    import lookm_jax
    from lookm_jax import generate as gen
    from lookm_jax.inputs import open_image

    method_from_args(args)  # bad options and images are refused before the model loads
    gen.Sampling(args.temperature, args.top_p)
    paths = default_images(args)
    images = [open_image(path) for path in paths]
    if args.context is None and not images:
        raise InputError("lookm chat needs pictures (--image) or --context text to compress")
    context = args.context if args.context is not None else "".join(
        f"Picture {k}: {IMAGE_MARKER}\n" for k in range(1, len(images) + 1))
    check_image_markers(context, len(images))
    context = f"{IMAGE_MARKER}\n" * (len(images) - context.count(IMAGE_MARKER)) + context
    model = lookm_jax.load(args.model, args.dtype) if args.model else lookm_jax.load_default(args.dtype)
    conversation = start(args, model, context, images)
    print(describe_context(conversation, args.method), flush=True)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break
        question = line.strip()
        if not question:
            continue
        try:
            text, _ = conversation.ask(question, max_new_tokens=args.max_new_tokens, **sampling_kwargs(args))
        except ValueError as err:  # InputError: one line, and the context stays as it was
            print(f"lookm: error: {err}", file=sys.stderr, flush=True)
            continue
        print(f"answer: {text}", flush=True)
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("chat", help="ask questions, one a line, about pictures encoded and compressed once")
    c.add_argument("--model", type=path_arg, help="HF llava/llama checkpoint folder, converted folder, or .gguf file "
                                                  "(default: the embedded SmolLM2 demo model)")
    c.add_argument("--image", action="append",
                   help="image file, repeatable (default: the demo model's two bundled pictures; none for --model)")
    c.add_argument("--context", help="text of the context before the questions, with an <image> marker per picture it "
                                     "places (default: 'Picture k: <image>' lines, one per picture)")
    add_sampling_arguments(c, max_new_tokens=48)
    add_method_arguments(c)
    c.set_defaults(func=cmd_chat)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """--max-new-tokens, --seed, --temperature, --top-p, --dtype, --ignore-context-limit."""
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=max_new_tokens, help="tokens to generate at most")
    parser.add_argument("--ignore-context-limit", action="store_true",
                        help="run even when prompt + new tokens exceed the model's max_position_embeddings")
    parser.add_argument("--seed", type=seed_arg, default=0, help="sampling seed")
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--dtype", choices=PARAM_DTYPES, default="float32", help="parameter and activation dtype")

"""A question asked after compression: prefilled onto the cache in one block vs one decode step a token.

    python bench/ask_cpu.py [--question-tokens 32] [--budget 0.2] [--repeats 7] [--json PATH]

On the demo model (SmolLM2-135M decoder, the two bundled pictures as the context, compressed by
LOOK-M at --budget), times (a) `generate.prefill_question`, the block that `Model.ask` runs: the
question's tokens encoded onto a copy of the context's cache in one compiled program; (b) the same
number of sequential decode steps on that cache (`generate.decode` with no EOS), which is what
feeding the question as forced decode tokens costs (forcing only replaces the sampled token). The
two alternate round by round and each figure is the best of its rounds (the median beside it);
compile time is excluded. Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench_args import at_least, json_path, kept_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--question-tokens", type=at_least(1), default=32, help="question length (default 32)")
    parser.add_argument("--budget", type=kept_fraction, default=0.2, help="LOOK-M's kept fraction (default 0.2)")
    parser.add_argument("--repeats", type=at_least(1), default=7, help="rounds, best taken (default 7)")
    parser.add_argument("--json", type=json_path, help="also write the figures to this file")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    import lookm_jax
    from lookm_jax import generate as gen
    from lookm_jax.chat import Conversation
    from lookm_jax.cli_args import DEFAULT_IMAGES

    model = lookm_jax.load_default()
    pixels, _ = model.preprocess_images(DEFAULT_IMAGES)
    conversation = Conversation(model, "Picture 1: <image>\nPicture 2: <image>\n", pixels,
                                method=lookm_jax.get_method("lookm", budget=args.budget))
    context = conversation.context  # the chat's start, as `lookm chat` compresses it
    cfg, params, n = model.text_config, model.params["text"], args.question_tokens
    key, sampling = jax.random.key(0), gen.Sampling()
    question = jnp.asarray(np.arange(100, 100 + n)[None], jnp.int32)
    valid = jnp.ones(question.shape, bool)

    def block():  # what Model.ask runs before decoding: the question onto a copy of the context
        return gen.prefill_question(cfg, params, context.cache, question, valid, key, room=n + 1, sampling=sampling)

    grown = jax.jit(lambda c: c.grow(n + 1))  # room for n tokens, as the forced steps write them

    def steps():  # n decode steps on the same context, one token each; the cache is donated
        return gen.decode(cfg, params, question[:, 0], grown(context.cache), key, max_new_tokens=n + 1,
                          sampling=sampling, eos_ids=())

    for run in (block, steps):  # compile
        jax.block_until_ready(run())
    times = {"block": [], "steps": []}
    for _ in range(args.repeats):
        for name, run in (("block", block), ("steps", steps)):
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in times.items()}
    result = {"question_tokens": n, "budget": args.budget, "context_tokens": int(context.prompt_lengths[0]),
              "context_slots": context.prompt_slots, "repeats": args.repeats,
              "prefill_onto_cache_ms": 1e3 * best["block"], "decode_steps_ms": 1e3 * best["steps"],
              "prefill_onto_cache_median_ms": 1e3 * float(np.median(times["block"])),
              "decode_steps_median_ms": 1e3 * float(np.median(times["steps"])),
              "speedup": best["steps"] / best["block"], "load_average": os.getloadavg()}
    print(f"demo model, context {result['context_tokens']} tokens compressed by LOOK-M {args.budget} to "
          f"{context.prompt_slots} slots; a {n}-token question, best of {args.repeats} "
          f"(median), load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"prefill onto the cache, one block: {result['prefill_onto_cache_ms']:.1f} ms "
          f"({result['prefill_onto_cache_median_ms']:.1f})")
    print(f"{n} decode steps, one token each:  {result['decode_steps_ms']:.1f} ms ({result['decode_steps_median_ms']:.1f})")
    print(f"speedup: {result['speedup']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Text-only replay for stage 2: prompts answered by the frozen decoder, and agreement with it.

Stage 2 trains the decoder (through adapters) to read pictures; to keep its text behaviour, every step
also fits the frozen SmolLM2's own greedy continuation of a text-only prompt (self-distillation on
its first `REPLAY_TOKENS` tokens, cross-entropy on the token ids it produced: no re-tokenisation).
Prompts are composed from templates and fillers; the "heldout" split uses fillers and two template
families the "train" split never draws, so the agreement measured on it is on prompts training never saw.
The train bank may add prompts the frozen decoder writes itself (`generated_prompts`, Magpie's recipe):
far more varied text than the templates, so what the replay holds fixed is more of what text can be.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

REPLAY_TOKENS = 32  # the frozen continuation's length kept as targets, and the agreement's span

# (template, filler key): a filler key names a pair of FILLERS lists, the train split's and the
# held-out split's; "number" fills {a} and {b} with NUMBER_PAIRS pairs of the split's range.
TEMPLATES = {
    "train": (("What is the capital of {country}?", "country"), ("Tell me a fun fact about {country}.", "country"),
              ("Tell me one fact about {animal}.", "animal"), ("What do {animal} eat?", "animal"),
              ("Write a short poem about {noun}.", "noun"), ("Give me three tips for {activity}.", "activity"),
              ("Why do people like {activity}?", "activity"), ("Explain {concept} in simple words.", "concept"),
              ("What is the opposite of '{adjective}'?", "adjective"), ("Can you suggest a dinner with {food}?", "food"),
              ("Describe {place} in two sentences.", "place"), ("What is {a} plus {b}?", "number")),
    "heldout": (("What is the capital of {country}?", "country"), ("Tell me one fact about {country}.", "country"),
                ("Tell me one fact about {animal}.", "animal"), ("Write a short poem about {noun}.", "noun"),
                ("Write a haiku about {noun}.", "noun"), ("Explain {concept} in simple words.", "concept"),
                ("Why is {concept} important?", "concept"), ("Give me a synonym for '{adjective}'.", "adjective"),
                ("What is the opposite of '{adjective}'?", "adjective"), ("How do I get better at {activity}?", "activity"),
                ("Describe {place} in two sentences.", "place"), ("Can you suggest a dinner with {food}?", "food"),
                ("What is {a} times {b}?", "number")),
}
FILLERS = {
    "country": (("France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Norway", "Peru", "Spain", "Chile",
                 "Greece", "Mexico", "Poland", "Turkey", "Vietnam"),
                ("Italy", "Germany", "Australia", "Argentina", "Sweden", "Thailand", "Morocco", "Portugal")),
    "animal": (("dolphins", "elephants", "owls", "bees", "penguins", "wolves", "octopuses", "camels", "frogs",
                "horses", "sharks", "ants"), ("giraffes", "bats", "turtles", "parrots", "foxes", "whales")),
    "noun": (("the sea", "autumn", "a city at night", "the moon", "coffee", "a garden", "rain", "mountains", "friendship",
              "a train journey", "winter", "the desert"), ("the stars", "spring", "a forest", "a river", "books", "snow")),
    "activity": (("learning to cook", "running a marathon", "studying for exams", "saving money", "gardening",
                  "learning a language", "public speaking", "playing chess", "sleeping well", "writing"),
                 ("painting", "swimming", "programming", "photography", "meditation")),
    "concept": (("gravity", "photosynthesis", "inflation", "the internet", "evolution", "electricity", "democracy",
                 "vaccines", "recycling", "the water cycle"),
                ("black holes", "machine learning", "interest rates", "climate change", "DNA")),
    "adjective": (("hot", "happy", "fast", "bright", "strong", "early", "quiet", "rich", "heavy", "old"),
                  ("tall", "brave", "soft", "empty", "clean")),
    "food": (("rice", "potatoes", "chicken", "lentils", "pasta", "eggs", "mushrooms", "beans"),
             ("salmon", "tofu", "spinach", "noodles")),
    "place": (("Paris", "a beach in summer", "a busy market", "a library", "the Alps", "a small village"),
              ("Tokyo", "a rainforest", "an old castle", "a train station")),
}
NUMBER_RANGES = {"train": (2, 40), "heldout": (41, 99)}  # operands of the arithmetic prompts
NUMBER_PAIRS = 40
SPLITS = ("train", "heldout")
GENERATED_TOKENS = 48  # the most tokens a generated user turn may take (longer ones are dropped)
GENERATION_BATCH = 32
GENERATION_DRAWS = 10  # batches drawn at most per GENERATION_BATCH prompts asked (SmolLM2: ~1.5)


def prompts(split: str, seed: int) -> tuple[str, ...]:
    """Every prompt of `split` (each template with each of its fillers, NUMBER_PAIRS seeded operand
    pairs for arithmetic), in a seeded order."""
    if split not in SPLITS:
        raise ValueError(f"unknown replay split {split!r}; expected one of {SPLITS}")
    rng = np.random.default_rng([7, SPLITS.index(split), seed])
    texts = []
    for template, key in TEMPLATES[split]:
        if key == "number":
            low, high = NUMBER_RANGES[split]
            pairs = {tuple(int(v) for v in rng.integers(low, high + 1, 2)) for _ in range(4 * NUMBER_PAIRS)}
            texts += [template.format(a=a, b=b) for a, b in sorted(pairs)[:NUMBER_PAIRS]]
        else:
            texts += [template.format(**{key: filler}) for filler in FILLERS[key][SPLITS.index(split)]]
    order = rng.permutation(len(texts))
    return tuple(texts[i] for i in order)


@dataclasses.dataclass(frozen=True)
class Bank:
    """Prompts with the frozen decoder's greedy continuation of each (its first REPLAY_TOKENS tokens,
    ended by its end-of-sequence token when it stopped sooner)."""
    prompts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]  # the chat-rendered prompt, as `Model.encode_chat` gives it
    continuations: tuple[tuple[int, ...], ...]

    def save(self, path: str) -> None:
        from lookm_jax.train.runs import write_atomic

        write_atomic(path, json.dumps(dataclasses.asdict(self)).encode())

    @classmethod
    def load(cls, path: str) -> "Bank":
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: tuple(tuple(v) if isinstance(v, list) else v for v in data[k]) for k in data})


def greedy_continuations(model, prompt_ids: list[np.ndarray], batch_size: int = 32,
                         progress: bool = False) -> list[list[int]]:
    """Greedy continuations of chat-rendered prompts ([1, L] ids each), REPLAY_TOKENS long, cut after
    the first end-of-sequence token. Right-padded batches through `model.generate` (full cache)."""
    from tqdm import tqdm

    eos = set(model.text_config.eos_token_ids)
    out = []
    for i in tqdm(range(0, len(prompt_ids), batch_size), desc="replay continuations", unit="batch", disable=not progress):
        rows = [p[0] for p in prompt_ids[i:i + batch_size]]
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for j, r in enumerate(rows):
            ids[j, :len(r)], mask[j, :len(r)] = r, 1
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=REPLAY_TOKENS)
        for row in np.asarray(tokens):
            stop = next((t + 1 for t, tok in enumerate(row) if int(tok) in eos), len(row))
            out.append([int(t) for t in row[:stop]])
    return out


def generated_prompts(model, count: int, seed: int, progress: bool = False) -> tuple[str, ...]:
    """`count` distinct user turns written by `model` itself (Magpie, Xu et al. 2024): its chat template
    rendered up to where a user's text begins, then sampled (temperature 1) until its end-of-turn
    token. Turns that do not end within GENERATED_TOKENS, hold an image marker, or equal a held-out
    prompt (seeds 0 and `seed`) are dropped. Deterministic in (model, count, seed)."""
    from tqdm import tqdm

    from lookm_jax.models import processors

    if not model.manifest.get("chat_template"):
        raise ValueError("generated replay prompts need a model with a chat template (to open a user turn)")
    marker = "\x00user-text\x00"
    rendered = model.chat_text(marker)
    prefix = np.asarray([model.processor.encode(model.tokenizer, rendered[:rendered.index(marker)], None)], np.int32)
    held_out = {p.strip().lower() for s in {0, seed} for p in prompts("heldout", s)}
    eos = set(model.text_config.eos_token_ids)
    found: dict[str, None] = {}  # insertion-ordered set
    bar = tqdm(total=count, desc="replay prompts", unit="prompt", disable=not progress)
    draws = GENERATION_DRAWS * -(-count // GENERATION_BATCH)
    for draw in range(draws):
        if len(found) >= count:
            break
        tokens = model.generate(np.repeat(prefix, GENERATION_BATCH, axis=0), max_new_tokens=GENERATED_TOKENS,
                                temperature=1.0, seed=int(np.random.default_rng([11, seed, draw]).integers(2**31)))
        for row in np.asarray(tokens).tolist():
            end = next((i for i, t in enumerate(row) if t in eos), None)
            text = None if end is None else model.decode_text(np.asarray(row[:end], np.int32)).strip()
            if text and processors.IMAGE_MARKER not in text and text.lower() not in held_out and text not in found:
                found[text] = None
                bar.update(1)
    bar.close()
    if len(found) < count:
        raise ValueError(f"the model wrote {len(found)} usable distinct user turns in {draws} batches of "
                         f"{GENERATION_BATCH}, fewer than the {count} asked")
    return tuple(found)[:count]


def make_bank(model, split: str, seed: int, generated: int = 0, progress: bool = False) -> Bank:
    """The prompts of `split` (+ `generated` prompts `model` writes itself) answered by `model`, the
    frozen decoder."""
    texts = prompts(split, seed) + (generated_prompts(model, generated, seed, progress) if generated else ())
    ids = [model.encode_chat(t) for t in texts]
    continuations = greedy_continuations(model, ids, progress=progress)
    return Bank(tuple(texts), tuple(tuple(int(t) for t in i[0]) for i in ids), tuple(map(tuple, continuations)))


def bank(model, directory: str, split: str, seed: int, generated: int = 0, progress: bool = False) -> Bank:
    """The run's bank of `split` (replay_{split}.json in `directory`), made once by the frozen model
    and read back on resume (made again if its prompts are not this split's templates followed by
    `generated` others)."""
    path = os.path.join(directory, f"replay_{split}.json")
    templated = prompts(split, seed)
    if os.path.exists(path):
        saved = Bank.load(path)
        if saved.prompts[:len(templated)] == templated and len(saved.prompts) == len(templated) + generated:
            return saved
    made = make_bank(model, split, seed, generated, progress)
    made.save(path)
    return made


def forced_divergence(reference_model, model, prompt_ids: list[np.ndarray],
                      reference: list[list[int]]) -> dict:
    """How `model` leaves `reference_model`'s greedy continuations (`reference`, of `prompt_ids`), read with
    the reference's own tokens as the prefix (teacher forcing), so one early difference does not count
    for every token after it as in `agreement`:
    - "forced_agreement": share of all the reference's tokens (pooled over prompts, as the trainer's
      `decoder.replay_metrics` pools them) that are `model`'s argmax after the same prefix;
    - "gap_at_divergence": at each prompt's first differing token, the reference model's probability of its
      own token minus that of `model`'s choice, median over those prompts (small: the reference nearly chose
      the same); None if no token differs.
    """
    hits, total, gaps = 0, 0, []
    for ids, continuation in zip(prompt_ids, reference, strict=True):
        tokens = np.asarray(continuation, ids.dtype)  # [T]
        sequence = np.concatenate([ids[0], tokens])[None]  # [1, L + T]
        start, end = ids.shape[1] - 1, ids.shape[1] - 1 + len(tokens)  # logits predicting each reference token
        choices = model.logits(sequence)[0, start:end].argmax(-1)  # [T]
        hits, total = hits + int(np.sum(choices == tokens)), total + len(tokens)
        differing = np.flatnonzero(choices != tokens)
        if differing.size:
            t = differing[0]
            logits = reference_model.logits(sequence)[0, start + t]  # [V]
            probabilities = np.exp(logits - logits.max())
            probabilities /= probabilities.sum()
            gaps.append(float(probabilities[tokens[t]] - probabilities[choices[t]]))
    return {"forced_agreement": hits / max(total, 1), "gap_at_divergence": float(np.median(gaps)) if gaps else None}


def agreement(reference: list[list[int]], generated: list[list[int]]) -> float:
    """Share of the first REPLAY_TOKENS positions where two greedy continuations hold the same token
    (a continuation that stopped is padded with its end token, so two that stop together agree)."""
    def padded(row):
        row = list(row)[:REPLAY_TOKENS]
        return row + [row[-1] if row else -1] * (REPLAY_TOKENS - len(row))

    same = [np.mean(np.equal(padded(r), padded(g))) for r, g in zip(reference, generated, strict=True)]
    return float(np.mean(same))

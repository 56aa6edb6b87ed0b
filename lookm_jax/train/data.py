"""Training batches: scenes rendered, conversations tokenised with the chat template, answers marked.

A sample is one conversation: the first user turn holds the pictures and a question, each later
turn one more question; only the assistant's answer tokens (and its end-of-turn token) are
supervised. The prompt of a turn is exactly what `Model.encode_chat` gives at inference.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from PIL import Image

from lookm_jax import scenes
from lookm_jax.convert.tokenizer import apply_chat_template
from lookm_jax.models.processors import Processor


MAX_SINGLE_TURNS = 3  # `single_picture_spec` fits conversations of up to this many questions


@dataclasses.dataclass(frozen=True)
class Batch:
    ids: np.ndarray  # [B, L] int32, right-padded, one placeholder per image feature
    valid: np.ndarray  # [B, L] bool
    pixel_values: np.ndarray  # [B * pictures, 3, S, S] float32, in reading order
    target_positions: np.ndarray  # [B, A] int32: the position whose logits predict each target
    targets: np.ndarray  # [B, A] int32 answer tokens
    target_mask: np.ndarray  # [B, A] bool (False = padding)
    answer_start: np.ndarray  # [B, A] bool: the target is the first token of an answer (its word)


@dataclasses.dataclass(frozen=True)
class Encoder:
    """The model-side pieces a conversation needs: tokenizer, chat template, placeholder expansion."""
    tokenizer: object  # tokenizers.Tokenizer with the "<image>" special token
    chat_template: str
    image_token_id: int
    image_seq_length: int
    processor: Processor  # the model's own input side (its image preprocessor)
    special_tokens: dict  # the chat template's bos_token etc. (`Model.special_tokens`)

    @classmethod
    def of(cls, model) -> "Encoder":
        return cls(model.tokenizer, model.manifest["chat_template"], model.config.image_token_id,
                   model.config.image_seq_length, model.processor, model.special_tokens)

    def pixels(self, pictures: Sequence) -> np.ndarray:
        """PIL images -> pixel_values [N, 3, S, S] float32, as the model preprocesses them."""
        return self.processor.preprocess(list(pictures))[0]

    def conversation(self, turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        """[(user text, assistant text), ...] -> (ids with placeholders expanded, per id: 0 = prompt,
        1 = first token of an answer, 2 = later answer token)."""
        messages: list[dict] = []
        boundaries = []  # (answer start, answer end) in characters of the full text
        for user, assistant in turns:
            messages.append({"role": "user", "content": user})
            prefix = apply_chat_template(self.chat_template, messages, add_generation_prompt=True,
                                         special_tokens=self.special_tokens)
            messages.append({"role": "assistant", "content": assistant})
            full = apply_chat_template(self.chat_template, messages, add_generation_prompt=False,
                                       special_tokens=self.special_tokens)
            if not full.startswith(prefix):
                raise ValueError("the chat template does not render a turn's prompt as a prefix of the turn")
            boundaries.append((len(prefix), len(full.rstrip())))
        encoding = self.tokenizer.encode(full, add_special_tokens=False)
        ids, role, started = [], [], set()
        for token, (start, _) in zip(encoding.ids, encoding.offsets):
            n = self.image_seq_length if token == self.image_token_id else 1
            answer = next((i for i, (a, b) in enumerate(boundaries) if a <= start < b), None)
            ids += [token] * n
            role += [0 if answer is None else (2 if answer in started else 1)] * n
            started.add(answer)
        return ids, role

    def batch(self, conversations: Sequence[Sequence[tuple[str, str]]], pictures: Sequence,
              length: int, max_targets: int) -> Batch:
        """Pad conversations to `length` tokens and their targets to `max_targets` (both static)."""
        rows = [self.conversation(c) for c in conversations]
        b = len(rows)
        ids, valid = np.zeros((b, length), np.int32), np.zeros((b, length), bool)
        positions, targets = np.zeros((b, max_targets), np.int32), np.zeros((b, max_targets), np.int32)
        mask, first = np.zeros((b, max_targets), bool), np.zeros((b, max_targets), bool)
        for i, (row, role) in enumerate(rows):
            if len(row) > length:
                raise ValueError(f"a conversation of {len(row)} tokens does not fit the batch length {length}")
            where = [t for t, r in enumerate(role) if r and t > 0]
            if len(where) > max_targets:
                raise ValueError(f"{len(where)} answer tokens exceed max_targets={max_targets}")
            ids[i, :len(row)], valid[i, :len(row)] = row, True
            positions[i, :len(where)] = np.asarray(where) - 1
            targets[i, :len(where)] = [row[t] for t in where]
            mask[i, :len(where)] = True
            first[i, :len(where)] = [role[t] == 1 for t in where]
        pixel_values = self.pixels(pictures)
        return Batch(ids, valid, pixel_values, positions, targets, mask, first)


def single_picture_spec(batch_size: int, turns: int) -> BatchSpec:
    """Single-picture conversations of `turns` questions; the static length fits every one (measured
    over 3000 training scenes: 111 / 136 / 161 tokens at most for 1 / 2 / 3 turns)."""
    if not 1 <= turns <= MAX_SINGLE_TURNS:
        raise ValueError(f"turns must be in [1, {MAX_SINGLE_TURNS}], got {turns}")
    return BatchSpec(batch_size=batch_size, pictures=1, turns=turns, length=128 + 24 * (turns - 1),
                     max_targets=4 * turns)


def single_picture_conversation(sample: scenes.SingleSample) -> list[tuple[str, str]]:
    """The picture and the first question in one user turn, as `encode_chat(q, num_images=1)` writes it."""
    turns = [(q.text, scenes.answer_text(q.answer)) for q in sample.questions]
    turns[0] = ("<image>\n" + turns[0][0], turns[0][1])
    return turns


def multi_picture_conversation(sample: scenes.MultiSample) -> list[tuple[str, str]]:
    turns = [(q.text, scenes.answer_text(q.answer)) for q in sample.questions]
    turns[0] = (sample.prompt(sample.questions[0]), turns[0][1])
    return turns


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """One kind of training batch: its size, pictures per sample, turns, and static lengths."""
    batch_size: int
    pictures: int  # 1 = single-picture scenes (1-3 objects); more = one-object pictures, "Picture k:"
    turns: int
    length: int
    max_targets: int
    # Multi-picture samples draw their picture count from [min_pictures, pictures] (None: always
    # `pictures`); pixel_values stay [batch_size * pictures, ...], blank pictures padding the end.
    min_pictures: int | None = None
    text_facts: bool = False  # multi-picture samples: one turn asks about a sentence (`scenes.FACT_SENTENCE`)
    kinds: tuple[str, ...] = scenes.MULTI_KINDS  # multi-picture question kinds (`scenes.MULTI_TEMPLATES`)

    def __post_init__(self):
        if self.min_pictures is not None and not 1 <= self.min_pictures <= self.pictures:
            raise ValueError(f"min_pictures must be in [1, pictures={self.pictures}], got {self.min_pictures}")
        unknown = set(self.kinds) - set(scenes.PICTURE_KINDS)
        if unknown:
            raise ValueError(f"unknown question kinds {sorted(unknown)}; expected some of {scenes.PICTURE_KINDS}")

    def picture_count(self, split: str, seed: int, index: int) -> int:
        """The number of pictures of multi-picture sample `index` (seeded by the sample)."""
        if self.min_pictures is None:
            return self.pictures
        rng = scenes.split_rng(split, seed, 3 * 10**6 + index)  # apart from the samples' own streams
        return int(rng.integers(self.min_pictures, self.pictures + 1))

    def make(self, encoder: Encoder, split: str, seed: int, first_index: int, image_size: int) -> Batch:
        """Samples first_index .. first_index + batch_size - 1 of a split, rendered and encoded."""
        indices = range(first_index, first_index + self.batch_size)
        if self.pictures == 1:
            samples = [scenes.single_picture_sample(split, seed, i, self.turns) for i in indices]
            conversations = [single_picture_conversation(s) for s in samples]
            pictures = [scenes.render(s.scene, image_size) for s in samples]
        else:
            multi = [scenes.multi_picture_sample(split, seed, i, self.picture_count(split, seed, i), self.turns,
                                                 self.kinds, text_fact=self.text_facts) for i in indices]
            conversations = [multi_picture_conversation(s) for s in multi]
            pictures = [scenes.render(scene, image_size) for s in multi for scene in s.scenes]
            # Features fill the placeholders in order (`llava.embed`), so trailing pictures are unused.
            blank = Image.new("RGB", (image_size, image_size))
            pictures += [blank] * (self.batch_size * self.pictures - len(pictures))
        return encoder.batch(conversations, pictures, self.length, self.max_targets)

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


READ_COVERAGE = 0.25  # `answer_reads`: the share of a patch an object must show on for the patch to be read
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
    # [B, A, L] bool: for an answer's first token, the image tokens of the objects its answer reads
    # (`answer_reads`); all False for other targets and text answers. None when not known.
    read_mask: np.ndarray | None = None


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
              length: int, max_targets: int, reads: Sequence[Sequence[np.ndarray]] | None = None) -> Batch:
        """Pad conversations to `length` tokens and their targets to `max_targets` (both static).
        `reads`: per conversation, per answer, the indices of the image tokens it reads among the
        conversation's image tokens in reading order (`answer_reads`) -> `Batch.read_mask`."""
        rows = [self.conversation(c) for c in conversations]
        b = len(rows)
        ids, valid = np.zeros((b, length), np.int32), np.zeros((b, length), bool)
        positions, targets = np.zeros((b, max_targets), np.int32), np.zeros((b, max_targets), np.int32)
        mask, first = np.zeros((b, max_targets), bool), np.zeros((b, max_targets), bool)
        read_mask = None if reads is None else np.zeros((b, max_targets, length), bool)
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
            if reads is not None:
                starts = np.flatnonzero(first[i])
                if len(starts) != len(reads[i]):
                    raise ValueError(f"conversation {i} has {len(starts)} answers and {len(reads[i])} reads")
                image_positions = np.flatnonzero(np.asarray(row) == self.image_token_id)
                for start, read in zip(starts, reads[i]):
                    read_mask[i, start, image_positions[read]] = True
        pixel_values = self.pixels(pictures)
        return Batch(ids, valid, pixel_values, positions, targets, mask, first, read_mask)


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


def multi_picture_conversation(sample: scenes.MultiSample, count_form: str = scenes.COUNT_FORMS[0]) -> list[tuple[str, str]]:
    """The pictures and the first question in one user turn (`MultiSample.prompt`), each answer as
    `scenes.spoken_answer` says it."""
    turns = [(q.text, scenes.spoken_answer(q, count_form)) for q in sample.questions]
    turns[0] = (sample.prompt(sample.questions[0]), turns[0][1])
    return turns


def answer_reads(questions: Sequence[scenes.Question], pictures: Sequence[scenes.Scene], image_size: int,
                 tokens_per_picture: int, count_form: str = scenes.COUNT_FORMS[0]) -> list[np.ndarray]:
    """Per question, the image tokens (indices among the conversation's image tokens, one per patch,
    picture after picture) of the objects its answer's first token reads, a patch counting when the object
    shows on `READ_COVERAGE` of it or more: a single picture's named object, or all of its objects for a
    count; a multi-picture question's named or revealed picture's object, or the counted pictures' objects
    (nothing for a tallied count, whose first token is "1": it reads one picture a step); nothing for a
    text fact."""
    grid = int(round(tokens_per_picture ** 0.5))
    if grid * grid != tokens_per_picture or image_size % grid:
        raise ValueError(f"{tokens_per_picture} image tokens a picture are not a patch grid of a {image_size}-pixel picture")
    shown = [scenes.patch_coverage(scene, image_size, image_size // grid)[1:] >= READ_COVERAGE for scene in pictures]
    single = len(pictures) == 1 and all(q.kind in scenes.KINDS for q in questions)

    def picture_objects(k: int) -> np.ndarray:
        return k * tokens_per_picture + np.flatnonzero(shown[k].any(0))

    reads = []
    for q in questions:
        if single:
            reads.append(np.flatnonzero(shown[0].any(0) if q.kind == "count" else shown[0][q.subject]))
        elif q.kind == "count_pictures" and count_form == "tallied":
            reads.append(np.zeros(0, int))
        elif q.kind == "count_pictures":
            reads.append(np.concatenate([picture_objects(k) for k in q.counted] or [np.zeros(0, int)]))
        elif q.subject is not None:
            reads.append(picture_objects(q.subject))
        else:  # a text fact
            reads.append(np.zeros(0, int))
    return reads


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
    count_form: str = scenes.COUNT_FORMS[0]  # how a count of pictures is answered (`scenes.spoken_answer`)

    def __post_init__(self):
        if self.min_pictures is not None and not 1 <= self.min_pictures <= self.pictures:
            raise ValueError(f"min_pictures must be in [1, pictures={self.pictures}], got {self.min_pictures}")
        if self.count_form not in scenes.COUNT_FORMS:
            raise ValueError(f"count_form must be one of {scenes.COUNT_FORMS}, got {self.count_form!r}")
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
            shown = [(s.scene,) for s in samples]
        else:
            samples = [scenes.multi_picture_sample(split, seed, i, self.picture_count(split, seed, i), self.turns,
                                                   self.kinds, text_fact=self.text_facts) for i in indices]
            conversations = [multi_picture_conversation(s, self.count_form) for s in samples]
            shown = [s.scenes for s in samples]
        pictures = [scenes.render(scene, image_size) for row in shown for scene in row]
        # Features fill the placeholders in order (`llava.embed`), so trailing pictures are unused.
        pictures += [Image.new("RGB", (image_size, image_size))] * (self.batch_size * self.pictures - len(pictures))
        reads = [answer_reads(s.questions, row, image_size, encoder.image_seq_length, self.count_form)
                 for s, row in zip(samples, shown)]
        return encoder.batch(conversations, pictures, self.length, self.max_targets, reads)

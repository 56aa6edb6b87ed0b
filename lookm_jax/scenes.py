"""Procedural scenes: seeded pictures of coloured shapes and questions about them (numpy + PIL).

The demo's vision tower is trained on these (`lookm_jax.train`) and `lookm eval scenes` asks about
them. A scene holds 1-3 objects, each a colour from `COLOURS` and a shape from `SHAPES` with its own
size and position, on a varied background (tinted grey, gradient, noise). Splits are separated by
seed, and the pair `HELD_OUT` (a green triangle) is never drawn in the training split, so held-out
accuracy on it measures what generalises across colour-shape combinations.

Every question has a one-word answer, written "Red." / "Circle." / "Two." / "Left.".
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35), "green": (30, 160, 55), "blue": (35, 75, 215), "yellow": (240, 205, 25)}
SHAPES = ("circle", "square", "triangle")
HELD_OUT = ("green", "triangle")  # the colour-shape pair the training split never shows
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen")
SPLITS = {"train": 0, "heldout": 1, "combination": 2, "bench": 3}  # seed streams, disjoint by construction
MAX_OBJECTS = 3
# Position questions are asked only about objects this far (a fraction of the width) from the midline.
_POSITION_MARGIN = 0.14

QUESTION_TEMPLATES = {
    "colour": ("What colour is the {shape}?", "What color is the {shape}?", "Which colour is the {shape}?",
               "Tell me the colour of the {shape}."),
    "shape": ("What shape is the {colour} object?", "Which shape is {colour}?",
              "What is the shape of the {colour} object?", "Name the shape of the {colour} thing."),
    "count": ("How many shapes are in the picture?", "How many objects can you see?",
              "Count the shapes in the picture.", "How many shapes are there?"),
    "horizontal": ("Is the {colour} {shape} on the left or on the right?",
                   "Is the {colour} {shape} left or right?"),
    "vertical": ("Is the {colour} {shape} at the top or at the bottom?",
                 "Is the {colour} {shape} in the top or the bottom half?"),
}
KINDS = ("colour", "shape", "count", "position")


@dataclasses.dataclass(frozen=True)
class SceneObject:
    colour: str
    shape: str
    x: float  # centre, as a fraction of the width (0 = left)
    y: float  # centre, as a fraction of the height (0 = top)
    radius: float  # half extent, as a fraction of the width


@dataclasses.dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    background: tuple[int, int, int]
    gradient: tuple[float, float]  # brightness change across x and y, in grey levels
    noise_seed: int

    def shows(self, pair: tuple[str, str]) -> bool:
        """Whether an object of this scene is that (colour, shape) pair."""
        return any((o.colour, o.shape) == pair for o in self.objects)


@dataclasses.dataclass(frozen=True)
class Question:
    kind: str  # one of KINDS, MULTI_KINDS or "text_fact"
    text: str
    answer: str  # one lower-case word
    subject: int | None = None  # the object (or picture) index the question names or reveals
    counted: tuple[int, ...] = ()  # count_pictures: the pictures its answer counts
    shapes: tuple[str, ...] = ()  # count_pictures: every picture's shape, in order (`tallied_count`)


def answer_text(answer: str) -> str:
    """The trained answer form: "red" -> "Red."."""
    return answer.capitalize() + "."


def listed_count(question: Question) -> str:
    """A count of pictures answered listing them first: "2,5,7: three.", "None: zero." (a small decoder
    counts what it has just written down; digits and commas are one token each)."""
    listed = ",".join(str(k + 1) for k in question.counted) or "None"
    return f"{listed}: {question.answer}."


def tallied_count(question: Question) -> str:
    """A count of pictures answered going through them in order: each picture's shape and the running count
    after it, in words, then the count: "1 circle (zero), 2 square (one), 3 square (two): two."
    Each step reads one named picture (what a model answers best) and either copies the tally just
    written or steps it by one, instead of searching all the pictures at once; the count copies the
    last tally."""
    if not question.shapes or any(k >= len(question.shapes) for k in question.counted):
        raise ValueError(f"a tallied count needs every picture's shape, got shapes {question.shapes} for the counted "
                         f"pictures {question.counted}")
    tally, steps = 0, []
    for k, shape in enumerate(question.shapes):
        tally += k in question.counted
        steps.append(f"{k + 1} {shape} ({NUMBERS[tally]})")
    return f"{', '.join(steps)}: {question.answer}."


# How a count of pictures is answered: the count alone ("Three."), the pictures listed first
# (`listed_count`), or every picture in turn with a running count (`tallied_count`).
COUNT_FORMS = ("word", "listed", "tallied")


def spoken_answer(question: Question, count_form: str = COUNT_FORMS[0]) -> str:
    """The trained answer to `question`: `answer_text`, or a count of pictures in `count_form`."""
    if count_form not in COUNT_FORMS:
        raise ValueError(f"count_form must be one of {COUNT_FORMS}, got {count_form!r}")
    if question.kind == "count_pictures" and count_form != "word":
        return listed_count(question) if count_form == "listed" else tallied_count(question)
    return answer_text(question.answer)


def split_rng(split: str, seed: int, index: int) -> np.random.Generator:
    """The generator of sample `index` of a split: the same triple always gives the same sample."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    return np.random.default_rng([SPLITS[split], seed, index])


def _allowed_pairs(split: str) -> list[tuple[str, str]]:
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    return [p for p in pairs if p != HELD_OUT] if split == "train" else pairs


def random_scene(rng: np.random.Generator, split: str, n_objects: int | None = None,
                 must_include: tuple[str, str] | None = None) -> Scene:
    """1-3 objects with distinct colour-shape pairs, placed without overlap."""
    n = int(rng.integers(1, MAX_OBJECTS + 1)) if n_objects is None else n_objects
    pairs = _allowed_pairs(split)
    chosen = [] if must_include is None else [must_include]
    while len(chosen) < n:
        pair = pairs[rng.integers(len(pairs))]
        # Beside a required pair, nothing shares its colour or its shape (questions name it by either).
        if pair not in chosen and (must_include is None or not set(pair) & set(must_include)):
            chosen.append(pair)
    rng.shuffle(chosen)
    objects: list[SceneObject] = []
    for colour, shape in chosen:
        for _ in range(200):
            radius = float(rng.uniform(0.11, 0.2 if n > 1 else 0.3))
            x, y = (float(v) for v in rng.uniform(radius + 0.02, 1 - radius - 0.02, size=2))
            if all(max(abs(x - o.x), abs(y - o.y)) > radius + o.radius + 0.03 for o in objects):
                break
        else:  # the canvas is full: shrink instead of overlapping
            radius, (x, y) = 0.08, (float(v) for v in rng.uniform(0.1, 0.9, size=2))
        objects.append(SceneObject(colour, shape, x, y, radius))
    light = rng.random() < 0.75
    level = rng.uniform(165, 245) if light else rng.uniform(25, 80)
    tint = rng.uniform(-18, 18, size=3)
    background = tuple(int(np.clip(level + t, 0, 255)) for t in tint)
    gradient = tuple(float(g) for g in rng.uniform(-30, 30, size=2))
    return Scene(tuple(objects), background, gradient, int(rng.integers(2**31)))


def render(scene: Scene, size: int = 112) -> Image.Image:
    """The scene as a size x size RGB picture (drawn at 2x, then box-filtered down)."""
    big = 2 * size
    ramp = np.linspace(-0.5, 0.5, big, dtype=np.float32)
    shade = scene.gradient[0] * ramp[None, :] + scene.gradient[1] * ramp[:, None]
    noise = np.random.default_rng(scene.noise_seed).normal(0, 5, (big, big, 3)).astype(np.float32)
    canvas = np.asarray(scene.background, np.float32) + shade[..., None] + noise
    image = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for o in scene.objects:
        draw_object(draw, o, big, COLOURS[o.colour])
    return image.resize((size, size), Image.Resampling.BOX)


def draw_object(draw: ImageDraw.ImageDraw, o: SceneObject, size: int, fill) -> None:
    """Draw `o` on a size x size canvas: the one place the shapes' geometry is defined."""
    x, y, r = o.x * size, o.y * size, o.radius * size
    if o.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif o.shape == "square":
        s = 0.85 * r  # a square of the same area as the circle is ~0.89 r; keep the sizes comparable
        draw.rectangle((x - s, y - s, x + s, y + s), fill=fill)
    else:
        draw.polygon([(x, y - r), (x + r, y + 0.8 * r), (x - r, y + 0.8 * r)], fill=fill)


def patch_coverage(scene: Scene, size: int, patch: int) -> np.ndarray:
    """[1 + objects, P], row-major over the (size // patch)^2 patches of the picture rendered at `size`:
    the share of each patch's pixels showing the background (row 0) and each object (row i: object i,
    1-based in `scene.objects` order, later objects over earlier ones as `render` draws them). Drawn
    at twice the size with `render`'s geometry."""
    big = 2 * size
    ids = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(ids)
    for i, o in enumerate(scene.objects, start=1):
        draw_object(draw, o, big, i)
    grid = np.asarray(ids).reshape(size // patch, 2 * patch, size // patch, 2 * patch).transpose(0, 2, 1, 3)
    grid = grid.reshape(-1, (2 * patch) ** 2)
    return np.stack([(grid == i).mean(-1) for i in range(len(scene.objects) + 1)])


def patch_owner(scene: Scene, size: int, patch: int) -> np.ndarray:
    """[P] int: the object (1-based) covering most of each patch, 0 for background (`patch_coverage`)."""
    return patch_coverage(scene, size, patch).argmax(0)


def _unique(scene: Scene, field: str) -> list[SceneObject]:
    values = [getattr(o, field) for o in scene.objects]
    return [o for o in scene.objects if values.count(getattr(o, field)) == 1]


def questions(scene: Scene, rng: np.random.Generator, kind: str,
              target: SceneObject | None = None) -> Question | None:
    """A random question of `kind` about `scene` (about `target` when given), or None if the scene
    cannot answer one (the object is not the only one of its shape, colour, or too central)."""
    def phrase(key: str, **fields) -> str:
        templates = QUESTION_TEMPLATES[key]
        return templates[rng.integers(len(templates))].format(**fields)

    if kind == "count":
        return Question(kind, phrase("count"), NUMBERS[len(scene.objects)])
    if kind == "colour":
        candidates = [o for o in _unique(scene, "shape") if target in (None, o)]
        if candidates:
            o = candidates[rng.integers(len(candidates))]
            return Question(kind, phrase("colour", shape=o.shape), o.colour, scene.objects.index(o))
        return None
    if kind == "shape":
        candidates = [o for o in _unique(scene, "colour") if target in (None, o)]
        if candidates:
            o = candidates[rng.integers(len(candidates))]
            return Question(kind, phrase("shape", colour=o.colour), o.shape, scene.objects.index(o))
        return None
    if kind == "position":
        options = [(axis, o) for o in scene.objects for axis in ("horizontal", "vertical")
                   if target in (None, o) and abs((o.x if axis == "horizontal" else o.y) - 0.5) >= _POSITION_MARGIN]
        if not options:
            return None
        axis, o = options[rng.integers(len(options))]
        low, high = ("left", "right") if axis == "horizontal" else ("top", "bottom")
        answer = low if (o.x if axis == "horizontal" else o.y) < 0.5 else high
        return Question(kind, phrase(axis, colour=o.colour, shape=o.shape), answer, scene.objects.index(o))
    raise ValueError(f"unknown question kind {kind!r}; expected one of {KINDS}")


def sample_question(scene: Scene, rng: np.random.Generator, kinds: tuple[str, ...] = KINDS,
                    target: SceneObject | None = None) -> Question:
    """A question of a random kind, drawn again until the scene can answer one (count always can;
    with a `target`, its colour and shape are unique in the scene by construction)."""
    while True:
        q = questions(scene, rng, kinds[rng.integers(len(kinds))], target)
        if q is not None:
            return q


def _conversation(scene: Scene, rng: np.random.Generator, turns: int, first: Question | None) -> list[Question]:
    """Up to `turns` questions (starting with `first`) none of which an earlier turn's text answers.

    A colour, shape or position question names one attribute of an object and its answer gives
    another, so after one such turn the object's colour and shape are both in the text: each object
    is the subject of at most one question, and the count is asked at most once. A scene with few
    objects therefore has fewer turns.
    """
    qs = [first] if first is not None else []
    options = [("count", None)] + [(k, o) for o in scene.objects for k in ("colour", "shape", "position")]
    while len(qs) < turns:
        used = {q.subject for q in qs if q.kind != "count"}
        options = [(k, o) for k, o in options if (k == "count" and all(q.kind != "count" for q in qs))
                   or (o is not None and scene.objects.index(o) not in used)]
        if not options:
            break
        kind, target = options.pop(int(rng.integers(len(options))))
        q = questions(scene, rng, kind, target)
        if q is not None:
            qs.append(q)
    return qs


@dataclasses.dataclass(frozen=True)
class SingleSample:
    scene: Scene
    questions: tuple[Question, ...]


def single_picture_sample(split: str, seed: int, index: int, turns: int = 1,
                          kind: str | None = None) -> SingleSample:
    """Scene `index` of a split with up to `turns` questions that do not answer each other (the first
    of `kind` when given, see `_conversation`).

    The "combination" split draws a green triangle (`HELD_OUT`) in every scene and first asks its
    colour or shape; nothing else in that scene shares either.
    """
    rng = split_rng(split, seed, index)
    if split == "combination":
        scene = random_scene(rng, split, must_include=HELD_OUT)
        target = next(o for o in scene.objects if (o.colour, o.shape) == HELD_OUT)
        first = sample_question(scene, rng, ("colour", "shape"), target)
    else:
        scene = random_scene(rng, split)
        first = questions(scene, rng, kind) if kind is not None else None
        while kind is not None and first is None:  # e.g. every object near the middle
            scene = random_scene(rng, split)
            first = questions(scene, rng, kind)
    return SingleSample(scene, tuple(_conversation(scene, rng, turns, first)))


def single_picture_samples(split: str, seed: int, n: int, turns: int = 1,
                           kind: str | None = None) -> Iterator[SingleSample]:
    """Samples 0 .. n-1 of a split (`single_picture_sample`)."""
    for index in range(n):
        yield single_picture_sample(split, seed, index, turns, kind)


MULTI_TEMPLATES = {
    "picture_colour": ("What colour is the shape in picture {k}?", "Which colour is the object in picture {k}?"),
    "picture_shape": ("What shape is in picture {k}?", "Which shape does picture {k} show?"),
    "which_picture": ("Which picture shows the {colour} {shape}?", "In which picture is the {colour} {shape}?"),
    "count_pictures": ("How many pictures show a {shape}?", "In how many pictures is there a {shape}?"),
}
MULTI_KINDS = tuple(MULTI_TEMPLATES)  # the tasks stage 1 trained on (the default of `multi_picture_sample`)
# Asked by stage 2 (`lookm_jax.train.decoder`) and `lookm eval scenes` beside MULTI_KINDS: where the
# shape of picture k is, and "describe picture k", answered in words ("A red circle at the top left.").
MULTI_TEMPLATES.update({
    "picture_position": ("Is the shape in picture {k} on the left or on the right?",
                         "Is the shape in picture {k} at the top or at the bottom?"),
    "describe": ("Describe picture {k}.", "What does picture {k} show?",
                 "Describe picture {k} in a few words."),
})
PICTURE_KINDS = tuple(MULTI_TEMPLATES)
# A text fact: one sentence between the pictures of a training conversation, and a question about it,
# so that stage 1 also asks about text beside pictures (without them the projected image tokens came
# to override any question: the needle among pictures was answered with a count word). Worded apart
# from the needle benchmark's "special magic number" sentence.
FACT_SUBJECTS = ("otter", "heron", "badger", "falcon", "lynx", "marten", "osprey", "walrus", "gecko", "ibis")
FACT_SENTENCE = "The code of the {subject} is {number}."
FACT_QUESTIONS = ("What is the code of the {subject}?", "Which code does the {subject} have?")


@dataclasses.dataclass(frozen=True)
class MultiSample:
    scenes: tuple[Scene, ...]  # one object each; "picture k" is scenes[k - 1]
    questions: tuple[Question, ...]
    fact: tuple[int, str] | None = None  # (k, sentence): the sentence follows picture k (1-based)

    def shows(self, pair: tuple[str, str]) -> bool:
        """Whether any of the pictures shows that (colour, shape) pair."""
        return any(s.shows(pair) for s in self.scenes)

    def prompt(self, question: Question) -> str:
        """MileBench-style: a "Picture k:" marker before each picture (the fact's sentence after its
        picture), the question last."""
        lines = []
        for k in range(1, len(self.scenes) + 1):
            lines.append(f"Picture {k}: <image>\n")
            if self.fact is not None and self.fact[0] == k:
                lines.append(self.fact[1] + "\n")
        return "".join(lines) + question.text


def describe(o: SceneObject) -> str:
    """The "describe" answer: colour, shape and where ("a red circle at the top left"; "in the
    middle" when the centre is within the position margin of both midlines)."""
    vertical = "top" if o.y < 0.5 - _POSITION_MARGIN else "bottom" if o.y > 0.5 + _POSITION_MARGIN else ""
    horizontal = "left" if o.x < 0.5 - _POSITION_MARGIN else "right" if o.x > 0.5 + _POSITION_MARGIN else ""
    where = " ".join(w for w in (vertical, horizontal) if w)
    place = f"at the {where}" if vertical else f"on the {where}" if horizontal else "in the middle"
    return f"a {o.colour} {o.shape} {place}"


def multi_question(scenes: tuple[Scene, ...], rng: np.random.Generator, kind: str,
                   exclude: frozenset[int] = frozenset()) -> Question | None:
    """A question of `kind` whose answer needs the pictures, about a picture not in `exclude`
    (None if these pictures cannot answer one). Its `subject` is the picture it names or reveals."""
    templates = MULTI_TEMPLATES[kind]
    text = templates[rng.integers(len(templates))]
    objects = [s.objects[0] for s in scenes]
    free = [i for i in range(len(objects)) if i not in exclude]
    if kind in ("picture_colour", "picture_shape"):
        if not free:
            return None
        k = free[rng.integers(len(free))]
        o = objects[k]
        return Question(kind, text.format(k=k + 1), o.colour if kind == "picture_colour" else o.shape, k)
    if kind == "picture_position":  # the template's axis; pictures too near its midline cannot answer
        axis = "horizontal" if "left" in text else "vertical"
        near = [i for i in free if abs((objects[i].x if axis == "horizontal" else objects[i].y) - 0.5) >= _POSITION_MARGIN]
        if not near:
            return None
        k = near[rng.integers(len(near))]
        low, high = ("left", "right") if axis == "horizontal" else ("top", "bottom")
        return Question(kind, text.format(k=k + 1), low if (objects[k].x if axis == "horizontal" else objects[k].y) < 0.5
                        else high, k)
    if kind == "describe":
        if not free:
            return None
        k = free[rng.integers(len(free))]
        return Question(kind, text.format(k=k + 1), describe(objects[k]), k)
    if kind == "which_picture":
        pairs = [(o.colour, o.shape) for o in objects]
        unique = [i for i in free if pairs.count(pairs[i]) == 1]
        if not unique:
            return None
        i = unique[rng.integers(len(unique))]
        return Question(kind, text.format(colour=objects[i].colour, shape=objects[i].shape), f"picture {i + 1}", i)
    if kind == "count_pictures":
        shape = SHAPES[rng.integers(len(SHAPES))]
        counted = tuple(i for i, o in enumerate(objects) if o.shape == shape)
        return Question(kind, text.format(shape=shape), NUMBERS[len(counted)], counted=counted,
                        shapes=tuple(o.shape for o in objects))
    raise ValueError(f"unknown question kind {kind!r}; expected one of {MULTI_KINDS}")


def multi_picture_sample(split: str, seed: int, index: int, pictures: int, turns: int = 1,
                         kinds: tuple[str, ...] = MULTI_KINDS, text_fact: bool = False) -> MultiSample:
    """Set `index` of `pictures` one-object scenes, with up to `turns` questions across them that do
    not answer each other: each picture is the subject of at most one question, and no question
    is asked twice. With `text_fact`, one of the turns (at a random place) asks instead about a
    sentence after a random picture (`FACT_SENTENCE`); the pictures and the other questions are
    those of the same sample without it."""
    if not 1 <= pictures < len(NUMBERS):
        raise ValueError(f"pictures must be in [1, {len(NUMBERS) - 1}], got {pictures}")
    rng = split_rng(split, seed, 10**6 + index)  # apart from the single-picture samples' streams
    while True:  # pictures that can answer none of `kinds` (e.g. no unique colour-shape pair) are redrawn
        scenes = tuple(random_scene(rng, split, n_objects=1) for _ in range(pictures))
        order = [kinds[i] for i in rng.permutation(len(kinds))]
        qs: list[Question] = []
        for attempt in range(8 * turns):
            if len(qs) == turns:
                break
            q = multi_question(scenes, rng, order[attempt % len(order)],
                               frozenset(q.subject for q in qs if q.subject is not None))
            if q is not None and all(q.text != p.text for p in qs):
                qs.append(q)
        if qs:
            break
    if not text_fact:
        return MultiSample(scenes, tuple(qs))
    subject = FACT_SUBJECTS[rng.integers(len(FACT_SUBJECTS))]
    number = str(int(rng.integers(1000, 10000)))
    question = FACT_QUESTIONS[rng.integers(len(FACT_QUESTIONS))].format(subject=subject)
    qs = qs[:turns - 1]
    qs.insert(int(rng.integers(len(qs) + 1)), Question("text_fact", question, number))
    fact = (int(rng.integers(1, pictures + 1)), FACT_SENTENCE.format(subject=subject, number=number))
    return MultiSample(scenes, tuple(qs), fact)


# The demo's bundled pictures (lookm_jax/assets/scene_1.png, scene_2.png are these, rendered).
DEMO_SCENES = (
    Scene((SceneObject("red", "circle", 0.28, 0.3, 0.17), SceneObject("blue", "square", 0.72, 0.7, 0.16)),
          (232, 230, 226), (12.0, -8.0), 11),
    Scene((SceneObject("yellow", "triangle", 0.5, 0.45, 0.25),), (60, 62, 70), (-10.0, 14.0), 12),
)

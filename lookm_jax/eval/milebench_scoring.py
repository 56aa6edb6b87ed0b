"""MileBench scoring, reproducing the benchmark's released evaluator (MileBench/MileBench `evaluate.py`).

What was followed, function by function:
- `normalize` is `Eval.process`: newlines/tabs to spaces, strip, `processPunctuation` (each of
  ``;/[]"{}()=+\\_-><@`,?!`` is deleted when it touches a space in the original text, or when the
  text holds a digit-comma-digit group, otherwise replaced by a space; then periods not followed by
  a digit are deleted, at most 32 of them: the original passes `re.UNICODE` (= 32) as `count`),
  strip quotes, lower-case. Colons and apostrophes inside the text survive, as there.
- `needle_correct`: datasets named *NeedleInAHaystack*, the normalized answer is one of
  the normalized prediction's whitespace-split words; `substring_correct`: MMCoQA, a substring.
- `rouge_l`: `rouge.Rouge().get_scores(pred, gt)[0]["rouge-l"]["f"]` of the `rouge==1.0.1` package
  that MileBench pins, re-implemented: summary-level ROUGE-L over sentences split at ".", with that
  package's default ``exclusive=True``, so word counts are counts of *distinct* words and the union
  LCS is a set of words; F = 2PR / (P + R + 1e-8). An empty normalized prediction scores 0, as
  there; one of periods only (left by the 32-period cap) also scores 0, where the package raises.
- `match_choice` is `Eval.match_choice` on normalized text and options {"A": option, ...}:
  (1) the first "letter option" occurrence, (2) an option's text with spaces removed inside the
  prediction with spaces removed, (3) the prediction is a bare option letter, else (4) every
  character of the prediction that is an option letter, concatenated. Its quirks are kept, because
  the paper's numbers include them: an empty prediction selects "C"; options are regex-escaped
  before step (2)'s equality test, so an option holding a regex character never matches there.
"""

from __future__ import annotations

import re

# Scored by the dataset's name, as MileBench does: "NeedleInAHaystack" (TextNeedleInAHaystack,
# ImageNeedleInAHaystack) by whole word, "MMCoQA" by substring; the rest by question type.
NEEDLE_MARKER = "NeedleInAHaystack"
SUBSTRING_MARKER = "MMCoQA"
QUESTION_TYPES = ("multi-choice", "open-ended")

_PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",",
                "?", "!")
_COMMA_BETWEEN_DIGITS = re.compile(r"(\d)(,)(\d)")
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"(?!<=\d)(\.)(?!\d)")  # sic: a lookahead for "<=digit", as released
_REGEX_SPECIALS = ("\\", ".", "^", "$", "*", "+", "?", "{", "}", "[", "]", "|", "(", ")")


def _strip_punctuation(text: str) -> str:
    out = text
    for p in _PUNCTUATION:
        if p + " " in text or " " + p in text or _COMMA_BETWEEN_DIGITS.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_NOT_BEFORE_DIGIT.sub("", out, 32)


def normalize(text: str) -> str:
    """MileBench's answer normalization (see the module docstring)."""
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return _strip_punctuation(text).strip("'").strip('"').strip().lower()


def needle_correct(prediction: str, answer: str) -> bool:
    return normalize(answer) in normalize(prediction).split()


def substring_correct(prediction: str, answer: str) -> bool:
    return normalize(answer) in normalize(prediction)


# ---- ROUGE-L (rouge==1.0.1, summary level, exclusive) ---------------------------------------------
def _sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def _words(sentences: list[str]) -> list[str]:
    return [w for s in sentences for w in s.split(" ")]


def _lcs_table(x: list[str], y: list[str]) -> list[list[int]]:
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
    return table


def lcs_words(x: list[str], y: list[str]) -> list[str]:
    """One longest common subsequence of x and y, with the package's tie-breaking (prefer moving in y)."""
    table = _lcs_table(x, y)
    out, i, j = [], len(x), len(y)
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            out.append(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def rouge_l(prediction: str, answer: str) -> float:
    """ROUGE-L F of two already-normalized strings, as MileBench computes it.

    A prediction with no sentence (empty, or only periods) scores 0; the package would raise there.
    """
    hyp, ref = _sentences(prediction), _sentences(answer)
    if not ref:
        raise ValueError(f"ROUGE-L needs a reference sentence, got {answer!r}")
    if not hyp:
        return 0.0
    union: set[str] = set()
    for ref_sentence in ref:
        for hyp_sentence in hyp:
            union.update(lcs_words(ref_sentence.split(" "), hyp_sentence.split(" ")))
    recall = len(union) / len(set(_words(ref)))
    precision = len(union) / len(set(_words(hyp)))
    return 2.0 * precision * recall / (precision + recall + 1e-8)


# ---- multiple choice ------------------------------------------------------------------------------
def _escaped(option: str) -> str:
    """MileBench's `preprocess_option_string`: normalize, then backslash-escape regex characters."""
    option = normalize(option)
    for char in _REGEX_SPECIALS:
        option = option.replace(char, "\\" + char)
    return option


def match_choice(prediction: str, options: dict[str, str]) -> str:
    """The option letter(s) a normalized prediction selects; options {"A": normalized text, ...}."""
    if prediction == "":
        return "C"
    found = re.search("(" + "|".join(_escaped(f"{k} {v}") for k, v in options.items()) + ")", prediction, re.S)
    if found:
        return found.group(0)[0].upper()
    bare = prediction.replace(" ", "")
    found = re.search("(" + "|".join(_escaped(v).replace(" ", "") for v in options.values()) + ")", bare, re.S)
    if found:
        for k, v in options.items():
            if found[0].strip() == _escaped(v).replace(" ", ""):
                return k.upper()
    if len(prediction) == 1 and prediction.upper() in options:
        return prediction.upper()
    return "".join(c.upper() for c in prediction if c.upper() in options)


def choice_letters(n: int) -> list[str]:
    """MileBench's option keys chr(65 + i): A, B, ... (past Z they run on through ASCII, as there)."""
    return [chr(65 + i) for i in range(n)]


def multi_choice_correct(prediction: str, answer: str, choices: list[str]) -> bool:
    choices = [normalize(c) for c in choices]
    answer = normalize(answer)
    if answer not in choices:
        raise ValueError(f"answer {answer!r} is not among the choices {choices}")
    options = dict(zip(choice_letters(len(choices)), choices))
    return match_choice(normalize(prediction), options) == choice_letters(len(choices))[choices.index(answer)]


def score(dataset: str, question_type: str, prediction: str, answer: str, choices: list[str] | None) -> float:
    """One sample's score in [0, 1], chosen by dataset and question type exactly as MileBench's `main`."""
    if NEEDLE_MARKER in dataset:
        return float(needle_correct(prediction, answer))
    if SUBSTRING_MARKER in dataset:
        return float(substring_correct(prediction, answer))
    if question_type == "open-ended":
        return rouge_l(normalize(prediction), normalize(answer))
    if question_type == "multi-choice":
        return float(multi_choice_correct(prediction, answer, choices or []))
    raise ValueError(f"{dataset}: question_type must be one of {QUESTION_TYPES}, got {question_type!r}")

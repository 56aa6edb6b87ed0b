"""The append-only JSONL files of the benchmark harnesses: one JSON object per line, appended as
each result finishes, so an interrupted run leaves at most its last line cut short."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Mapping

from lookm_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class Field:
    """What one field of a record accepts: a JSON type (bool, int, str, or float: any number), then
    `choices`, or the range [low, high] ((low, high] with `open_low`; a bound of None: unbounded)."""
    kind: type
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple = ()
    optional: bool = False  # may be absent (rows written before the field existed)

    def accepts(self, value) -> bool:
        if isinstance(value, bool) != (self.kind is bool):  # JSON true is no number
            return False
        if not isinstance(value, (int, float) if self.kind is float else self.kind):
            return False
        if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN and Infinity
            return False
        if self.choices:
            return value in self.choices
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(json.dumps(c) for c in self.choices)
        name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.low is None:
            return name
        if self.high is None:
            return f"{name} >= {self.low}"
        return f"{name} in {'(' if self.open_low else '['}{self.low}, {self.high}]"


def read_records(path: str, fields: Mapping[str, Field], what: str) -> list[dict]:
    """Every complete line of `path` as a dict ([] when there is no file yet); a last line cut short
    by an interrupted write is ignored. A line that is not a JSON object whose `fields` hold what
    they accept raises InputError naming the file, the line and the field; `what` names a record."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not a UTF-8 JSONL file ({err})") from None
    required = [k for k, field in fields.items() if not field.optional]
    records = []
    for number, line in enumerate(lines[:-1], 1):  # lines[-1]: "" or a cut line
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise InputError(f"{path}, line {number}: not JSON ({err})") from None
        if not isinstance(record, dict) or not set(required) <= record.keys():
            lacks = f": no {', '.join(k for k in required if k not in record)}" if isinstance(record, dict) else ""
            raise InputError(f"{path}, line {number}: not a {what} (a JSON object with {', '.join(required)}){lacks}")
        for key, field in fields.items():
            if key in record and not field.accepts(record[key]):
                raise InputError(f"{path}, line {number}: {key} {json.dumps(record[key])} is not {field.describe()}")
        records.append(record)
    return records


def drop_cut_line(path: str) -> bool:
    """Truncate `path` after its last complete line; True if a cut line was dropped."""
    if not os.path.exists(path):
        return False
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return False
        f.truncate(data.rfind(b"\n") + 1)
    return True

"""The append-only JSONL files of the benchmark harnesses: one JSON object per line, appended as
each result finishes, so an interrupted run leaves at most its last line cut short."""

from __future__ import annotations

import json
import os
from typing import Sequence

from lookm_jax.errors import InputError


def read_records(path: str, required: Sequence[str], what: str) -> list[dict]:
    """Every complete line of `path` as a dict ([] when there is no file yet); a last line cut short
    by an interrupted write is ignored. A line that is not a JSON object holding the `required` keys
    raises InputError naming the file and the line; `what` names a record in that message."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not a UTF-8 JSONL file ({err})") from None
    records = []
    for number, line in enumerate(lines[:-1], 1):  # lines[-1]: "" or a cut line
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise InputError(f"{path}, line {number}: not JSON ({err})") from None
        if not isinstance(record, dict) or not set(required) <= record.keys():
            raise InputError(f"{path}, line {number}: not a {what} (a JSON object with {', '.join(required)})")
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

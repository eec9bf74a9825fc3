"""Who holds a key another agent created, from the JSON record it wrote there: for the
one line that refuses a second agent (a held node id, registration.py; a held GPU,
devices.py). The record is another process's writing, so whatever it holds is shown
printable and short: it cannot forge a second line."""

from __future__ import annotations

import json
from typing import Sequence

from elastic_runner.etcd.client import KeyValue


def holder_record(kv: KeyValue | None) -> dict:
    """The holder's record; {} where there is none or it is not a JSON object."""
    try:
        record = json.loads(kv.value) if kv is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def who(record: dict, fields: Sequence[tuple[str, str]]) -> str:
    """`label value` for each (field, label) the record has, e.g. "host h, pid 12"."""
    return ", ".join(f"{label} {printable(record[field])}" for field, label in fields
                     if record.get(field) not in (None, ""))


def printable(value: object) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in str(value))[:100]

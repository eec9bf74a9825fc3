"""The one grammar for run and node ids.

Run and node ids become etcd key segments, file names (--log-dir) and values in
generated shell and YAML (deploy). One grammar for all of them: no '/', so a run's
prefix ("<run_id>/") can never contain another run's keys and a node id is one key
segment; no '..' or leading '.', so no path escapes its folder; no whitespace or
quotes, so nothing can be injected into a script.
"""

from __future__ import annotations

import re

ID_GRAMMAR = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_ID = re.compile(ID_GRAMMAR)


def id_problem(value: str) -> str | None:
    """Why `value` is not a valid run or node id, or None when it is."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        return (f"{value!r} is not a valid id: use 1-128 characters from letters, digits, "
                f"'.', '_' and '-', starting with a letter or digit ({ID_GRAMMAR})")
    if ".." in value:
        return f"{value!r} is not a valid id: '..' is not allowed"
    return None

"""How `elastic-run deploy` makes a user's value safe for each file it writes.

Every value from the command line ends up in one of three targets, each with its
own rule (issue 12, defect 7: a newline in a flag used to inject a shell line
into the sbatch script and a whole YAML document into the manifests):

- names the rendered objects are keyed by (run id, job / Deployment name,
  namespace) and the values of `#SBATCH` lines are *validated*: `#SBATCH` lines
  are read by sbatch, not by the shell, one line each, so no quoting can carry a
  newline there. Invalid values are `ConfigError`s: one line, exit 2.
- everything else in the sbatch script is quoted by `shell_quote`: `shlex.quote`
  when the value is printable, else bash's `$'...'` with the unprintable
  characters as `\\xHH` bytes (locale-independent), so that every value stays on
  one line -- a comment line too (the header records the deploy command).
- YAML is written by `yaml.safe_dump_all` from plain Python data (deploy.py):
  the library picks the quoting. Kubernetes additionally expands `$(VAR)` in a container's
  command, args and env values; `kube_literal` doubles each `$` of a user's value
  (`$$` is Kubernetes' escape for `$`), so the value reaches the process as typed.

Torch-, grpc- and etcd-free, like the rest of the verb.
"""

from __future__ import annotations

import re
import shlex
from typing import Iterable

from elastic_runner.errors import ConfigError
from elastic_runner.ids import id_problem

# Kubernetes object names and label values: a DNS-1123 label (the strictest of its rules).
DNS_LABEL = "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
# Slurm: one partition name or a comma-separated list of them.
PARTITION = "[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*"
# Slurm --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or unlimited.
TIME = r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite)"
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "'": "\\'"}


# ---- validation ---------------------------------------------------------------------
def printable(text: str) -> str:
    """`text` on one line: each unprintable character as its Python escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_text(argv: Iterable[str]) -> None:
    """Refuse NUL and bytes that are not UTF-8 (Python hands those over as lone surrogates)."""
    for token in argv:
        if "\0" in token:
            raise ConfigError(f"deploy: argument {token!r} holds a NUL character; remove it")
        try:
            token.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"deploy: argument {ascii(token)} is not valid UTF-8; "
                              "pass text") from None


def check_id(kind: str, flag: str, value: str) -> None:
    """Run ids and Slurm job names: the rendezvous id grammar."""
    problem = id_problem(value)
    if problem:
        raise ConfigError(f"deploy {kind}: {flag} {problem}")


def check_dns_label(flag: str, value: str) -> None:
    """A Kubernetes name that also serves as a label value: lowercase, at most 63."""
    if not re.fullmatch(DNS_LABEL, value):
        raise ConfigError(f"deploy kubernetes: {flag} {value!r} is not a valid Kubernetes name: "
                          "use 1-63 lowercase letters, digits and '-', starting and ending "
                          f"with a letter or digit ({DNS_LABEL})")


def check_grammar(flag: str, value: str, grammar: str, example: str) -> None:
    if not re.fullmatch(grammar, value):
        raise ConfigError(f"deploy slurm: {flag} {value!r} is not accepted in an #SBATCH line: "
                          f"use {example} ({grammar})")


# ---- shell --------------------------------------------------------------------------
def shell_quote(value: str) -> str:
    """One bash word that reads back as `value` and never spans a line."""
    if value.isprintable():
        return shlex.quote(value)
    out = []
    for char in value:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        else:
            out.extend(f"\\x{byte:02x}" for byte in char.encode("utf-8"))
    return "$'" + "".join(out) + "'"


def shell_join(words: Iterable[str]) -> str:
    return " ".join(shell_quote(word) for word in words)


# ---- kubernetes / YAML ----------------------------------------------------------------
def kube_literal(value: str) -> str:
    """A container arg or env value that Kubernetes' $(VAR) expansion leaves as typed."""
    return value.replace("$", "$$")

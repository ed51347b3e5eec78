"""Checks for text, paths and sizes that come from outside, in one place.

The models (`orka.models`), the servicers and the agent all use these, so a rule and its
message are the same wherever an input enters. Messages never echo unbounded input: a value
quoted in one goes through `quote`, which cuts it.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from typing import Annotated

from pydantic import AfterValidator

# Any value quoted in an error message is cut to this many characters.
MAX_QUOTED = 64

# Per-field limits of a workload spec (characters for text, entries for lists and maps).
MAX_NAME_LENGTH = 63
MAX_PATH_LENGTH = 4096  # PATH_MAX
MAX_IMAGE_LENGTH = 4096
MAX_ARG_LENGTH = 128 * 1024  # Linux's MAX_ARG_STRLEN: exec refuses a longer argument
MAX_ARGS = 1024
MAX_ENV_ENTRIES = 1024
MAX_ENV_KEY_LENGTH = 256
MAX_ENV_VALUE_LENGTH = 128 * 1024  # MAX_ARG_STRLEN again: an env entry is an exec string too
MAX_SELECTOR_ENTRIES = 64
MAX_LABEL_KEY_LENGTH = 253
MAX_LABEL_VALUE_LENGTH = 256
MAX_CMDLINE_LENGTH = 4096
# The whole spec, serialized: what each List response, watch event, offer and start carries.
MAX_SPEC_BYTES = 1 << 20

# Labels under this prefix are set by the scheduler only (`orka.io/node`, ...).
RESERVED_LABEL_PREFIX = "orka.io/"
# The node's name, from its certificate: what a workload pins itself to a node with.
NODE_LABEL = "orka.io/node"
# What an agent may announce at registration.
MAX_NODE_LABELS = 64
MAX_DRIVERS = 16
MAX_DRIVER_NAME = 64

# C0 controls, DEL and C1 controls; NUL is reported on its own (the most common attack).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# The same but tab and newline, which scripts in a command or an env value legitimately hold.
_CONTROL_BUT_WHITESPACE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def quote(value: object, limit: int = MAX_QUOTED) -> str:
    """`repr` of a value for an error message, cut to about `limit` characters with '...'.
    The text is cut before `repr` (cheap on a huge value) and after (escapes such as
    '\\U0010ffff' make a character ten)."""
    cut = False
    if isinstance(value, str | bytes) and len(value) > limit:
        value, cut = value[:limit], True
    text = repr(value)
    if len(text) > limit + 2:
        text, cut = text[: limit + 2], True
    return text + "..." if cut else text


def check_length(value: str, limit: int) -> str:
    if len(value) > limit:
        raise ValueError(f"is {len(value)} characters long, over the limit of {limit}")
    return value


def check_text(value: str, limit: int, multiline: bool = False) -> str:
    """No NUL and no control characters (but tab and newline when `multiline`), at most
    `limit` characters."""
    check_length(value, limit)
    if "\0" in value:
        raise ValueError("contains a NUL byte")
    found = (_CONTROL_BUT_WHITESPACE if multiline else _CONTROL).search(value)
    if found is not None:
        raise ValueError(
            f"contains a control character ({found.group()!r} at offset {found.start()})"
        )
    return value


def check_path(value: str, limit: int = MAX_PATH_LENGTH) -> str:
    """An absolute, normalised path: a relative one would resolve against whatever directory
    the agent runs in, and `..` could leave any directory it is confined to."""
    check_text(value, limit)
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {quote(value)}")
    if value.startswith("//") or posixpath.normpath(value) != value:
        raise ValueError(
            f"must be a normalised path (no '.' or '..' component, no '//', no trailing '/'),"
            f" got {quote(value)}"
        )
    return value


def path_within(path: str, roots: Iterable[str]) -> bool:
    """True when a normalised absolute `path` is one of `roots` or under one."""
    for root in roots:
        root = root.rstrip("/") or "/"
        if path == root or path.startswith(root if root == "/" else root + "/"):
            return True
    return False


_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


def check_label_key(key: str) -> str:
    check_length(key, MAX_LABEL_KEY_LENGTH)
    if not _LABEL_KEY_RE.match(key):
        raise ValueError(
            f"{quote(key)} is not a valid label key (letters, digits, '.', '_', '/', '-',"
            " starting with a letter or digit)"
        )
    return key


def check_label_value(value: str) -> str:
    return check_text(value, MAX_LABEL_VALUE_LENGTH)


def reserved_labels(labels: Iterable[str]) -> list[str]:
    """The keys among `labels` that only the scheduler may set."""
    return sorted(k for k in labels if k.startswith(RESERVED_LABEL_PREFIX))


# Annotated types for pydantic fields: the error's location (`command[2]`, `env['K']`) comes
# from pydantic, the reason from the check.
Arg = Annotated[str, AfterValidator(lambda v: check_text(v, MAX_ARG_LENGTH, multiline=True))]
EnvValue = Annotated[
    str, AfterValidator(lambda v: check_text(v, MAX_ENV_VALUE_LENGTH, multiline=True))
]
LabelKey = Annotated[str, AfterValidator(check_label_key)]
LabelValue = Annotated[str, AfterValidator(check_label_value)]
AbsPath = Annotated[str, AfterValidator(lambda v: check_path(v) if v else v)]
CmdLine = Annotated[str, AfterValidator(lambda v: check_text(v, MAX_CMDLINE_LENGTH))]


def check_env_key(key: str) -> str:
    check_text(key, MAX_ENV_KEY_LENGTH)
    if not key or "=" in key:
        raise ValueError("must be non-empty without '='")
    return key


EnvKey = Annotated[str, AfterValidator(check_env_key)]

"""Data files only the service user may read: they hold specs, and specs hold secret values.

Modes are set at creation (no window where a file is readable by others) and tightened again
at start, so a data dir or file left by an older version with 0755/0644 is fixed in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

log = structlog.get_logger("orka.filemodes")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def _tighten(path: Path, mode: int) -> None:
    try:
        if os.stat(path).st_mode & 0o777 != mode:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass
    except PermissionError as err:
        # Not ours to change (another user created it): run, but say so.
        log.warning("cannot restrict access", path=str(path), mode=oct(mode), error=str(err))


def private_dir(path: Path) -> Path:
    """Create `path` and make it owner-only (0700); missing parents get the usual mode."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    _tighten(path, PRIVATE_DIR)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty if missing, and make it owner-only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    os.close(fd)
    _tighten(path, PRIVATE_FILE)
    return path


def tighten_file(path: Path) -> None:
    """Make an existing file owner-only (0600); a missing one is left missing."""
    _tighten(path, PRIVATE_FILE)

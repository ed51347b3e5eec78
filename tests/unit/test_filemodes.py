"""Owner-only data files and folders, at creation and for ones an older version left open."""

from __future__ import annotations

import os
from pathlib import Path

from orka.filemodes import private_dir, private_file, tighten_file


def mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def test_a_new_dir_is_owner_only(tmp_path: Path) -> None:
    path = private_dir(tmp_path / "a" / "b")
    assert mode(path) == 0o700
    assert (tmp_path / "a").is_dir()  # parents: the usual umask (they may be shared)


def test_an_existing_open_dir_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.mkdir(mode=0o755)
    (path / "keep").write_text("x")
    private_dir(path)
    assert mode(path) == 0o700
    assert (path / "keep").read_text() == "x"


def test_a_file_is_created_owner_only_or_tightened_with_its_content(tmp_path: Path) -> None:
    new = private_file(tmp_path / "new")
    assert mode(new) == 0o600 and new.read_bytes() == b""
    old = tmp_path / "old"
    old.write_text("kept")
    old.chmod(0o644)
    private_file(old)
    assert mode(old) == 0o600 and old.read_text() == "kept"


def test_tighten_file_leaves_a_missing_file_missing(tmp_path: Path) -> None:
    tighten_file(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    present = tmp_path / "present"
    present.write_text("x")
    present.chmod(0o666)
    tighten_file(present)
    assert mode(present) == 0o600

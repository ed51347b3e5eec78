"""Owner-only data files and folders, at creation and for ones an older version left open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from orka import filemodes
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


def test_modes_are_set_at_creation_not_only_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No window where a new folder or file is readable by others: created owner-only, before
    any tightening (which is here made to do nothing)."""
    monkeypatch.setattr(filemodes, "_tighten", lambda path, mode: None)
    old = os.umask(0o022)
    try:
        assert mode(private_dir(tmp_path / "d")) == 0o700
        assert mode(private_file(tmp_path / "f")) == 0o600
    finally:
        os.umask(old)


def _tighten_where_chmod_fails(
    path: Path, mode_before: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Path], list[dict[str, object]]]:
    """tighten_file on `path` (made with `mode_before`) with chmod failing as it does on
    another user's file; returns the paths chmod was asked for and what was logged."""
    path.write_text("x")
    path.chmod(mode_before)
    asked: list[Path] = []

    def chmod(target: Path, mode: int) -> None:
        asked.append(Path(target))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", chmod)
    with capture_logs() as logs:
        tighten_file(path)
    return asked, logs


def test_a_file_not_ours_to_change_is_used_and_named_in_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "theirs"
    asked, logs = _tighten_where_chmod_fails(path, 0o644, monkeypatch)
    assert asked == [path]
    assert logs == [
        {
            "event": "cannot restrict access",
            "log_level": "warning",
            "path": str(path),
            "mode": "0o600",
            "error": "[Errno 1] Operation not permitted",
        }
    ]


def test_a_file_already_private_is_left_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _tighten_where_chmod_fails(tmp_path / "ours", 0o600, monkeypatch) == ([], [])

"""secret_env_files: read inside the allowed directories only, content never in an error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orka.agent.secret_files import SecretFiles
from orka.errors import RuntimeFailure
from orka.models import MAX_SECRET_VALUE_BYTES, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec

VALUE = "v4lue-from-file"


def spec(**files: str) -> WorkloadSpec:
    return WorkloadSpec(
        name="db",
        kind=WorkloadKind.PROCESS,
        command=["x"],
        secret_env={"INLINE": "i"},
        secret_env_files=files,
    )


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    d = tmp_path / "secrets"
    d.mkdir()
    (d / "db").write_text(VALUE + "\n")  # as `echo ... > file` writes it
    return d


def test_files_inside_the_allowed_dir_become_secret_env(allowed: Path) -> None:
    (allowed / "sub").mkdir()
    (allowed / "sub" / "raw").write_bytes(b"two\nlines\n\n")
    os.symlink(allowed / "db", allowed / "link")  # a link that stays inside is fine
    got = SecretFiles([allowed]).resolve(
        spec(DB=str(allowed / "db"), RAW=str(allowed / "sub" / "raw"), L=str(allowed / "link"))
    )
    assert got.secret_env == {"INLINE": "i", "DB": VALUE, "RAW": "two\nlines\n", "L": VALUE}
    assert got.environment["DB"] == VALUE
    assert got.secret_env_files == {}
    # What the drivers get is a valid spec in its own right (RunSpec validates it again).
    assert RunSpec(instance="db-1", workload="db", spec=got).spec == got


def test_a_spec_without_files_is_returned_as_it_is() -> None:
    s = spec()
    assert SecretFiles().resolve(s) is s


def _refused(files: SecretFiles, s: WorkloadSpec) -> str:
    with pytest.raises(RuntimeFailure) as info:
        files.resolve(s)
    return info.value.message


def test_no_secret_dir_means_no_files(allowed: Path) -> None:
    message = _refused(SecretFiles(), spec(DB=str(allowed / "db")))
    assert message == (
        "secret_env_files: this node reads no secret files (its agent has no --secret-dir)"
    )


def test_paths_and_links_outside_the_allowed_dirs_are_refused(
    allowed: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "agent.key"
    outside.write_text("PRIVATE KEY")
    os.symlink(outside, allowed / "escape")
    files = SecretFiles([allowed])
    for path in (str(outside), str(allowed / "escape")):
        message = _refused(files, spec(K=path))
        assert message == (
            f"secret_env_files[K]: {path} is not inside the agent's --secret-dir ({allowed})"
        )
        assert "PRIVATE KEY" not in message


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"x" * (MAX_SECRET_VALUE_BYTES + 1), f"larger than {MAX_SECRET_VALUE_BYTES} bytes"),
        (b"a\0b-secret", "contains a NUL byte"),
        (b"\xff\xfe-secret", "not UTF-8 text"),
    ],
)
def test_bad_content_is_refused_without_quoting_it(
    allowed: Path, content: bytes, reason: str
) -> None:
    (allowed / "bad").write_bytes(content)
    message = _refused(SecretFiles([allowed]), spec(K=str(allowed / "bad")))
    assert message == f"secret_env_files[K]: {allowed / 'bad'}: {reason}"


def test_the_largest_value_fits_with_its_newline(allowed: Path) -> None:
    (allowed / "big").write_bytes(b"x" * MAX_SECRET_VALUE_BYTES + b"\n")
    got = SecretFiles([allowed]).resolve(spec(K=str(allowed / "big")))
    assert len(got.secret_env["K"]) == MAX_SECRET_VALUE_BYTES


def test_missing_files_fifos_and_dirs_are_refused_without_hanging(allowed: Path) -> None:
    os.mkfifo(allowed / "fifo")
    files = SecretFiles([allowed])
    assert _refused(files, spec(K=str(allowed / "nope"))).endswith(
        "nope: cannot open: No such file or directory"
    )
    assert _refused(files, spec(K=str(allowed / "fifo"))).endswith("fifo: not a regular file")
    assert _refused(files, spec(K=str(allowed))).endswith("secrets: not a regular file")


def test_a_refusal_names_every_allowed_dir(allowed: Path, tmp_path: Path) -> None:
    other = tmp_path / "more-secrets"
    other.mkdir()
    outside = tmp_path / "elsewhere"
    outside.write_text("x")
    message = _refused(SecretFiles([allowed, other]), spec(K=str(outside)))
    assert message == (
        f"secret_env_files[K]: {outside} is not inside the agent's --secret-dir "
        f"({allowed}, {other})"
    )


def test_a_link_that_appears_after_the_path_was_resolved_is_not_followed(
    allowed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check resolves links, then opens: a link swapped in between those two steps would
    lead outside. The open itself follows no link; here resolving is made to miss the link,
    as a swap just after it would."""
    outside = tmp_path / "agent.key"
    outside.write_text("PRIVATE KEY")
    os.symlink(outside, allowed / "swapped")
    files = SecretFiles([allowed])
    monkeypatch.setattr(os.path, "realpath", lambda path: str(path))
    message = _refused(files, spec(K=str(allowed / "swapped")))
    assert message == (
        f"secret_env_files[K]: {allowed / 'swapped'}: cannot open: "
        "Too many levels of symbolic links"
    )

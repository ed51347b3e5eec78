from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pytest

from orka.errors import Invalid
from orka.security.issue import init_certs, issue_cert
from orka.security.tls import TlsFiles, channel_credentials, load_and_check, server_credentials


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_certs(tmp_path, ["node-1"])
    return tmp_path


def test_for_service_prefers_named_cert(certs: Path) -> None:
    own = certs / "agent-node-1"
    assert TlsFiles.for_service(certs, "agent", "node-1") == TlsFiles(
        ca=own / "ca.crt", cert=own / "agent-node-1.crt", key=own / "agent-node-1.key"
    )
    ctl = certs / "controller"
    assert TlsFiles.for_service(certs, "controller", "controller").cert == ctl / "controller.crt"
    # An unnamed fallback: a controller called "c1" uses controller.crt.
    files = TlsFiles.for_service(certs, "controller", "c1")
    assert (files.cert, files.key, files.ca) == (
        ctl / "controller.crt",
        ctl / "controller.key",
        ctl / "ca.crt",
    )
    # The admin pair stays at the top, beside the CA certificate.
    assert TlsFiles.for_service(certs, "admin", "admin").key == certs / "admin.key"


def test_for_service_in_its_own_folder(certs: Path) -> None:
    # `--certs DIR/agent-node-1`: what `orka up` and compose hand each service.
    own = certs / "agent-node-1"
    files = TlsFiles.for_service(own, "agent", "node-1")
    assert (files.ca, files.cert, files.crl) == (
        own / "ca.crt",
        own / "agent-node-1.crt",
        own / "crl.pem",
    )
    assert load_and_check(files).uri == "spiffe://orka/agent/node-1"


def test_for_service_reads_flat_dirs(certs: Path) -> None:
    # A dir from before the split (or laid out by hand): every pair beside ca.crt.
    for p in (certs / "scheduler").iterdir():
        p.rename(certs / p.name)
    files = TlsFiles.for_service(certs, "scheduler", "scheduler")
    assert (files.ca, files.cert) == (certs / "ca.crt", certs / "scheduler.crt")


def test_for_service_own_folder_beats_a_stale_flat_pair(certs: Path) -> None:
    # `rotate` and `issue` write into the folder; a flat copy left beside it is older.
    shutil.copy(certs / "admin.crt", certs / "scheduler.crt")
    shutil.copy(certs / "admin.key", certs / "scheduler.key")
    files = TlsFiles.for_service(certs, "scheduler", "scheduler")
    assert files.cert == certs / "scheduler" / "scheduler.crt"


def test_for_service_missing_lists_paths(certs: Path) -> None:
    with pytest.raises(Invalid) as exc:
        TlsFiles.for_service(certs, "agent", "node-2")
    for tried in ("agent-node-2/agent-node-2.crt", "agent-node-2.crt", "agent/agent.crt"):
        assert str(certs / tried) in exc.value.message
    assert str(certs / "agent.crt") in exc.value.message


def test_for_service_missing_ca(certs: Path) -> None:
    (certs / "ca.crt").unlink()
    with pytest.raises(Invalid, match=r"ca\.crt"):
        TlsFiles.for_service(certs, "admin", "admin")


def test_credentials_build(certs: Path) -> None:
    files = TlsFiles.for_service(certs, "admin", "admin")
    assert server_credentials(files) is not None
    assert channel_credentials(files) is not None


def test_expired_cert(certs: Path) -> None:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    issue_cert(
        certs, "agent", "old", not_valid_before=start, not_valid_after=start + dt.timedelta(days=1)
    )
    with pytest.raises(Invalid, match=r"agent-old\.crt expired"):
        load_and_check(TlsFiles.for_service(certs, "agent", "old"))


def test_not_yet_valid_cert(certs: Path) -> None:
    start = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    issue_cert(
        certs, "agent", "new", not_valid_before=start, not_valid_after=start + dt.timedelta(days=1)
    )
    with pytest.raises(Invalid, match="not valid until"):
        load_and_check(TlsFiles.for_service(certs, "agent", "new"))


def test_wrong_ca(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("other")
    init_certs(other, [])
    shutil.copy(other / "ca.crt", certs / "ca.crt")
    with pytest.raises(Invalid, match="is not signed by the CA"):
        load_and_check(TlsFiles.for_service(certs, "admin", "admin"))


def test_key_mismatch(certs: Path) -> None:
    shutil.copy(certs / "controller" / "controller.key", certs / "admin.key")
    with pytest.raises(Invalid, match=r"admin\.key does not match"):
        load_and_check(TlsFiles.for_service(certs, "admin", "admin"))


def test_garbage_cert(certs: Path) -> None:
    (certs / "admin.crt").write_bytes(b"junk")
    with pytest.raises(Invalid, match=r"admin\.crt is not a PEM certificate"):
        load_and_check(TlsFiles.for_service(certs, "admin", "admin"))

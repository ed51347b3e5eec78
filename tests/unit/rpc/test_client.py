"""The channel factory: the server role is explicit and decides the name the handshake checks."""

from __future__ import annotations

import pytest

from orka.errors import Invalid
from orka.rpc.client import refused_role, secure_channel
from orka.security.issue import init_certs
from orka.security.tls import TlsFiles


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    d = tmp_path_factory.mktemp("certs")
    init_certs(d, ["node-1"])
    return TlsFiles.for_service(d, "agent", "node-1")


def test_server_role_is_required(tls: TlsFiles) -> None:
    with pytest.raises(TypeError):
        secure_channel("127.0.0.1:1", tls)  # type: ignore[call-arg]


@pytest.mark.parametrize("role", ["agent", "admin", "viewer", "", "*"])
async def test_only_a_serving_role_can_be_expected(tls: TlsFiles, role: str) -> None:
    with pytest.raises(Invalid, match=r"^role: .* does not serve"):
        secure_channel("127.0.0.1:1", tls, role)


def test_refused_role_explains_the_handshake_failures() -> None:
    hostname = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom "
        "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."
    )
    assert refused_role(hostname, "scheduler") == (
        "the server's certificate does not name role scheduler (scheduler.orka)"
    )
    purpose = "Tls handshake failed: CERTIFICATE_VERIFY_FAILED: unsupported certificate purpose"
    assert refused_role(purpose, "controller") == (
        "the server's certificate is not for serving (no serverAuth)"
    )
    assert refused_role("failed to connect to all addresses; Connection refused", "x") is None

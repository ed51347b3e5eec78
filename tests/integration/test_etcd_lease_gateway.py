"""The lease keeper on etcd's JSON gateway (orka/store/etcd_lease.py), against real etcd: plain
and with mutual TLS (a CA, a server certificate for 127.0.0.1 and a client certificate made
here), failing over past a dead endpoint, and NotFound once the lease is gone."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orka.errors import NotFound, Unavailable
from orka.store.etcd import EtcdStore, EtcdTls
from orka.store.etcd_lease import GatewayLeases
from tests.etcd import ETCD, EtcdCluster, free_port, needs_etcd
from tests.subprocs import reap

pytestmark = needs_etcd


@pytest.fixture
async def store(etcd: EtcdCluster, etcd_prefix: str) -> AsyncIterator[EtcdStore]:
    async with EtcdStore(etcd.endpoints, etcd_prefix) as s:
        yield s


async def test_a_keepalive_renews_a_live_lease_and_finds_a_revoked_one_gone(
    store: EtcdStore,
) -> None:
    keeper = store.lease_keeper()
    lease = await store.grant_lease(7)
    assert await keeper.keepalive_lease(lease) == 7
    await store.revoke_lease(lease)
    with pytest.raises(NotFound, match=f"lease {lease:x} has expired"):
        await keeper.keepalive_lease(lease)


async def test_a_dead_endpoint_is_passed_over_and_none_alive_is_unavailable(
    store: EtcdStore, etcd: EtcdCluster
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    lease = await store.grant_lease(5)
    keeper = GatewayLeases([dead, *etcd.endpoints], EtcdTls(), timeout=2)
    assert await keeper.keepalive_lease(lease) == 5
    alone = GatewayLeases([dead], EtcdTls(), timeout=2)
    with pytest.raises(Unavailable, match=f"no endpoint refreshed lease {lease:x}: {dead}"):
        await alone.keepalive_lease(lease)
    await store.revoke_lease(lease)


async def test_a_revoke_ends_a_lease_and_a_gone_one_is_no_error(
    store: EtcdStore, etcd: EtcdCluster
) -> None:
    keeper = store.lease_keeper()
    lease = await store.grant_lease(30)
    await keeper.revoke_lease(lease)
    with pytest.raises(NotFound):
        await store.keepalive_lease(lease)
    await keeper.revoke_lease(lease)  # gone already: the goal is met
    assert keeper.grpc is None  # etcd's own "not found", told apart from a gateway failing
    dead = GatewayLeases([f"127.0.0.1:{free_port()}"], EtcdTls(), timeout=2)
    with pytest.raises(Unavailable, match=f"no endpoint revoked lease {lease:x}"):
        await dead.revoke_lease(lease)


# ---- mutual TLS ----


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(
    dir: Path,
    stem: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    usages: list[x509.ObjectIdentifier],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(_name(stem) if issuer is None else issuer[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(key if issuer is None else issuer[1], hashes.SHA256())
    (dir / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (dir / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


@pytest.fixture(params=["server and client use", "server use only"])
def tls_etcd(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    """An etcd member that serves TLS and requires a client certificate from our CA. Its
    gateway dials etcd's own gRPC with the server pair: a pair for server use only leaves the
    gateway unable to serve (HTTP 503)."""
    ca = _issue(tmp_path, "ca", None, [])
    usages = [ExtendedKeyUsageOID.SERVER_AUTH]
    if request.param == "server and client use":
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    _issue(tmp_path, "server", ca, usages)
    _issue(tmp_path, "client", ca, [ExtendedKeyUsageOID.CLIENT_AUTH])
    client, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{client}"
    with (tmp_path / "etcd.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                str(ETCD),
                "--data-dir",
                str(tmp_path / "data"),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--cert-file",
                str(tmp_path / "server.crt"),
                "--key-file",
                str(tmp_path / "server.key"),
                "--trusted-ca-file",
                str(tmp_path / "ca.crt"),
                "--client-cert-auth",
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"127.0.0.1:{client}", tmp_path
    finally:
        proc.terminate()
        reap(proc, 10, 10)


async def test_the_keeper_speaks_mutual_tls_as_the_store_does(
    tls_etcd: tuple[str, Path], request: pytest.FixtureRequest
) -> None:
    endpoint, certs = tls_etcd
    gateway_serves = "client use" in request.node.callspec.id
    tls = {"ca": certs / "ca.crt", "cert": certs / "client.crt", "key": certs / "client.key"}
    async with EtcdStore([endpoint], "/tls", **tls, timeout=2) as store:
        lease = 0
        async with asyncio.timeout(30):
            while not lease:  # etcd is starting
                try:
                    lease = await store.grant_lease(9)
                except Unavailable:
                    await asyncio.sleep(0.2)
        keeper = store.lease_keeper()
        assert await keeper.keepalive_lease(lease) == 9
        # Renewed over HTTP where the gateway serves, else over a gRPC store of its own.
        assert (keeper.grpc is None) is gateway_serves
        assert await keeper.keepalive_lease(lease) == 9
        await keeper.close()
        assert keeper.grpc is None
        # A revoke the same way (a fresh keeper finds the gateway out again).
        revoker = store.lease_keeper()
        other_lease = await store.grant_lease(9)
        await revoker.revoke_lease(other_lease)
        assert (revoker.grpc is None) is gateway_serves
        with pytest.raises(NotFound):
            await store.keepalive_lease(other_lease)
        await revoker.close()
        # Without our client certificate etcd refuses the handshake: nothing is renewed.
        anonymous = GatewayLeases([endpoint], EtcdTls(ca=certs / "ca.crt"), timeout=2)
        with pytest.raises(Unavailable, match=endpoint):
            await anonymous.keepalive_lease(lease)
        # Nor does the keeper trust a server its CA did not sign.
        other = tmp_ca(certs / "other")
        strange = GatewayLeases([endpoint], EtcdTls(ca=other, **_client(certs)), timeout=2)
        with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await strange.keepalive_lease(lease)
        await store.revoke_lease(lease)


def _client(certs: Path) -> dict[str, Path]:
    return {"cert": certs / "client.crt", "key": certs / "client.key"}


def tmp_ca(dir: Path) -> Path:
    dir.mkdir()
    _issue(dir, "ca", None, [])
    return dir / "ca.crt"

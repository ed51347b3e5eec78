"""Every certificate the identity tables present: each role, and each way a cert can be bad.

One cluster CA (`Certs.dir`), a second CA for "other CA" rows, expired and not-yet-valid
certs of the roles that would otherwise be let in, and the kind of agent certificate older
Orka issued (serverAuth plus host names), which is what a rogue scheduler would hold.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orka.cli.main import main as cli_main
from orka.security.ca import CLOCK_SKEW, cert_pem, key_pem, spiffe_uri
from orka.security.issue import init_certs, issue_cert, load_ca
from orka.security.tls import TlsFiles

ROLES = ("admin", "viewer", "controller", "scheduler", "agent")
# The name each role's certificate carries in these tables.
NAMES = {
    "admin": "admin",
    "viewer": "alice",
    "controller": "controller",
    "scheduler": "scheduler",
    "agent": "node-1",
}
# Ways a certificate is refused before any role is looked at, in every listener and client
# table. "revoked" is a certificate of the cluster CA revoked with `orka certs revoke` (CRL
# in every service folder): gRPC cannot check a CRL in the handshake, so listeners refuse it
# right after it with UNAUTHENTICATED "certificate revoked" (orka/security/revocation.py),
# and an Orka server will not present one (orka/rpc/own_cert.py).
BAD = ("none", "other-ca", "expired", "not-yet-valid", "revoked")
# The name revoked certificates carry (`<role>-revoked`, or `revoked.crt` for the singletons).
REVOKED_NAME = "revoked"


@dataclass(frozen=True)
class Certs:
    dir: Path
    other: Path

    def role(self, role: str) -> TlsFiles:
        return TlsFiles.for_service(self.dir, role, NAMES[role])

    def bad(self, kind: str, role: str) -> TlsFiles | None:
        """A `role` certificate spoiled in way `kind`; None for "no certificate at all"."""
        ca = self.dir / "ca.crt"
        if kind == "none":
            return None
        if kind == "other-ca":
            other = TlsFiles.for_service(self.other, role, NAMES[role])
            return TlsFiles(ca=ca, cert=other.cert, key=other.key)
        if kind in ("expired", "not-yet-valid", REVOKED_NAME):
            return TlsFiles.for_service(self.dir, role, kind)
        raise ValueError(kind)

    def legacy_agent(self) -> TlsFiles:
        return TlsFiles(
            ca=self.dir / "ca.crt",
            cert=self.dir / "legacy-agent-node-2.crt",
            key=self.dir / "legacy-agent-node-2.key",
        )


def make_certs(root: Path) -> Certs:
    d, other = root / "certs", root / "other"
    init_certs(d, ["node-1", "node-2"])
    init_certs(other, ["node-1"])
    issue_cert(d, "viewer", NAMES["viewer"])
    issue_cert(other, "viewer", NAMES["viewer"])
    now = dt.datetime.now(dt.UTC)
    spans = {
        "expired": (now - dt.timedelta(days=10), now - dt.timedelta(days=9)),
        "not-yet-valid": (now + dt.timedelta(days=1), now + dt.timedelta(days=2)),
    }
    for role in ROLES:
        for kind, (start, end) in spans.items():
            issue_cert(d, role, kind, not_valid_before=start, not_valid_after=end)
        issue_cert(d, role, REVOKED_NAME)
        # The operator's path: the CLI writes the CA-signed CRL into DIR and every folder.
        argv = ["certs", "revoke", "--dir", str(d), "--role", role, "--name", REVOKED_NAME]
        with contextlib.redirect_stdout(io.StringIO()):  # its "wrote ..." lines
            assert cli_main(argv) == 0
    write_legacy_cert(d, "agent", "node-2", "legacy-agent-node-2")
    return Certs(dir=d, other=other)


def write_legacy_cert(d: Path, role: str, name: str, stem: str) -> TlsFiles:
    """A certificate as Orka issued them before roles were bound to the handshake (signed by
    the CA in `d`, written as `<stem>.crt/.key`): serverAuth and the host's names whatever the
    role, and no role DNS name, so it verifies as "127.0.0.1" to a client checking hosts."""
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return write_cert(d, role, name, stem, both, ["localhost", "127.0.0.1"])


def write_cert(
    d: Path,
    role: str,
    name: str,
    stem: str,
    usages: list[x509.ObjectIdentifier] | None,
    hosts: list[str],
) -> TlsFiles:
    """A certificate made by hand, with exactly these extended key usages (None: no EKU
    extension at all) and host names: shapes `orka certs` never issues."""
    ca = load_ca(d)
    key = ec.generate_private_key(ec.SECP256R1())
    start = dt.datetime.now(dt.UTC) - CLOCK_SKEW
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name))]
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role}/{name}")]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
    )
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    (d / f"{stem}.key").write_bytes(key_pem(key))
    (d / f"{stem}.crt").write_bytes(cert_pem(cert))
    return TlsFiles(ca=d / "ca.crt", cert=d / f"{stem}.crt", key=d / f"{stem}.key")


def channel_credentials_for(certs: Certs, files: TlsFiles | None) -> grpc.ChannelCredentials:
    """Credentials presenting `files` (or no certificate) and trusting the cluster CA."""
    ca = (certs.dir / "ca.crt").read_bytes()
    if files is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=files.key.read_bytes(),
        certificate_chain=files.cert.read_bytes(),
    )

"""A peer's certificate as gRPC hands it over (PEM), parsed once for every check of a call.

A call is checked more than once: the revocation interceptor and the audit record read the
certificate's serial, the handler its identity (orka.security.identity). When thousands of
agents register at once (a scheduler taking over), a parse per check would be paid several
times per registration; so the checks share one parse, and each keeps only a small value (the
serial here, the identity there) in caches sized for a large cluster.
"""

from __future__ import annotations

import functools

from cryptography import x509

from orka.errors import Unauthenticated

# Peers whose serial and identity are kept: every agent of a large cluster, and its
# controllers and admins. An entry is the PEM (under 1 KiB) and a small value.
PEERS = 8192


# Only the checks of one call need the parsed certificate, back to back.
@functools.lru_cache(maxsize=64)
def load(pem: bytes) -> x509.Certificate:
    """The parsed certificate; Unauthenticated if it does not parse (never cached)."""
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise Unauthenticated(f"peer certificate does not parse: {e}") from None


@functools.lru_cache(maxsize=PEERS)
def serial(pem: bytes) -> int:
    """The certificate's serial number; Unauthenticated if it does not parse (never cached)."""
    return load(pem).serial_number

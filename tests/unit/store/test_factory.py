from __future__ import annotations

from pathlib import Path

import pytest

from orka.errors import Invalid
from orka.store import EtcdStore, MemoryStore, SqliteStore, open_store

DATA = Path("/var/lib/orka")


@pytest.mark.parametrize(
    ("url", "db_path"),
    [
        ("", DATA / "orka.db"),
        ("   ", DATA / "orka.db"),
        ("sqlite://", DATA / "orka.db"),
        ("sqlite:///abs/path.db", Path("/abs/path.db")),
        ("SQLITE:///abs/path.db", Path("/abs/path.db")),
        ("sqlite:////double/slash.db", Path("/double/slash.db")),
        ("sqlite:///my%20dir/a%23b.db", Path("/my dir/a#b.db")),
    ],
)
def test_sqlite_urls(url: str, db_path: Path) -> None:
    store = open_store(url, DATA)
    assert isinstance(store, SqliteStore)
    assert store.path == db_path


@pytest.mark.parametrize(
    ("url", "endpoints", "prefix"),
    [
        ("etcd://127.0.0.1:2379", ["127.0.0.1:2379"], "/orka"),
        ("ETCD://a:2379, b:2380 ,c:1", ["a:2379", "b:2380", "c:1"], "/orka"),
        ("etcd://[::1]:2379/", ["[::1]:2379"], "/orka"),
        ("etcd://a:1/tenant-a/orka/", ["a:1"], "/tenant-a/orka"),
    ],
)
def test_etcd_urls(url: str, endpoints: list[str], prefix: str) -> None:
    store = open_store(url, DATA)
    assert isinstance(store, EtcdStore)
    assert store.endpoints == endpoints
    assert store.prefix == prefix
    assert not store.tls.enabled


def test_etcd_tls_from_url_and_flags() -> None:
    store = open_store("etcd://a:1?ca=/u/ca.crt&cert=/u/c.crt&key=/u/c.key&timeout=2.5", DATA)
    assert isinstance(store, EtcdStore)
    assert (store.tls.ca, store.tls.cert, store.tls.key) == (
        Path("/u/ca.crt"),
        Path("/u/c.crt"),
        Path("/u/c.key"),
    )
    assert store.timeout == 2.5
    # Flags win over the url.
    store = open_store("etcd://a:1?ca=/u/ca.crt", DATA, etcd_ca=Path("/f/ca.crt"))
    assert isinstance(store, EtcdStore)
    assert store.tls.ca == Path("/f/ca.crt") and store.tls.enabled


def test_memory_url() -> None:
    assert isinstance(open_store("memory://", DATA), MemoryStore)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("etcd://", "no etcd endpoint"),
        ("etcd://a:2379,b", "'b' is not HOST:PORT"),
        ("etcd://a:99999", "is not HOST:PORT"),
        ("etcd://a:2379?tls=1", "unknown option"),
        ("etcd://a:2379?ca=rel/ca.crt", "absolute path"),
        ("etcd://a:2379?cert=/c.crt", "cert and key must be given together"),
        ("etcd://a:2379?timeout=0", "timeout"),
        ("etcd://a:2379#x", "fragment"),
        ("postgres://db/orka", r"unsupported scheme.*sqlite:///.*memory://.*etcd://"),
        ("/abs/path.db", "unsupported scheme"),
        ("orka.db", "unsupported scheme"),
        ("sqlite://relative/x.db", "must be absolute"),
        ("sqlite:///", "directory"),
        ("sqlite:///var/lib/", "directory"),
        ("sqlite:///x.db?mode=ro", "no options"),
        ("sqlite:///a#b.db", "no options"),
        ("memory://somewhere", "memory://"),
        ("http://[::1", "store url"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(Invalid, match=match) as info:
        open_store(url, DATA)
    # The message names the url so a misconfigured flag is easy to spot.
    assert repr(url) in info.value.message


async def test_factory_store_opens(tmp_path: Path) -> None:
    async with open_store("", tmp_path / "data") as store:
        assert await store.put("node", "n", {}) == 1
    assert (tmp_path / "data" / "orka.db").exists()

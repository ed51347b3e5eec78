from __future__ import annotations

from pathlib import Path

import pytest

from orka.errors import Invalid
from orka.store import MemoryStore, SqliteStore, open_store

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


def test_memory_url() -> None:
    assert isinstance(open_store("memory://", DATA), MemoryStore)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("etcd://127.0.0.1:2379", "etcd store is not available in this build"),
        ("etcd://a:2379,b:2379", "etcd store is not available in this build"),
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

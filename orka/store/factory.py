"""Turn the controller's `--store URL` into a Store."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

from orka.errors import Invalid
from orka.store.base import Store
from orka.store.memory import MemoryStore
from orka.store.sqlite import SqliteStore

DEFAULT_DB_NAME = "orka.db"

ACCEPTED = (
    "sqlite:///ABS/PATH.db, sqlite:// (orka.db in the data dir), memory://, etcd://HOST:PORT[,...]"
)


def open_store(url: str, data_dir: Path) -> Store:
    """Build the store `url` names; the caller opens it (`async with open_store(...) as s`).

    An empty url means the default: SQLite in `data_dir`.
    """
    text = url.strip()
    if not text:
        return SqliteStore(data_dir / DEFAULT_DB_NAME)
    try:
        parts = urlsplit(text)
    except ValueError as exc:
        raise Invalid(f"store url {url!r}: {exc}; accepted: {ACCEPTED}") from exc
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        return SqliteStore(_sqlite_path(url, parts, data_dir))
    if scheme == "memory":
        if parts.netloc or parts.path or parts.query or parts.fragment:
            raise Invalid(f"store url {url!r}: memory:// takes no host, path or options")
        return MemoryStore()
    if scheme == "etcd":
        raise Invalid(
            f"store url {url!r}: etcd store is not available in this build; "
            "use sqlite:///ABS/PATH.db or sqlite:// (the default, in the data dir)"
        )
    raise Invalid(f"store url {url!r}: unsupported scheme; accepted: {ACCEPTED}")


def _sqlite_path(url: str, parts: SplitResult, data_dir: Path) -> Path:
    path = parts.path
    if parts.netloc:
        # sqlite://rel/x.db would silently put "rel" in the host part; insist on the
        # three-slash absolute form rather than guess what a relative path is relative to.
        raise Invalid(f"store url {url!r}: sqlite path must be absolute: sqlite:///ABS/PATH.db")
    if parts.query or parts.fragment:
        # A raw '?' or '#' would cut the path short silently; they must be percent-encoded.
        raise Invalid(f"store url {url!r}: sqlite:// takes no options (encode ? and # in paths)")
    if not path:
        return data_dir / DEFAULT_DB_NAME
    # Percent-decoding lets a path with spaces or '#' be written in the url.
    # SQLAlchemy habits write absolute paths with four slashes; POSIX would keep "//" as is.
    decoded = Path("/" + unquote(path).lstrip("/"))
    if path.endswith("/") or decoded == Path("/"):
        raise Invalid(f"store url {url!r}: sqlite path names a directory, not a database file")
    return decoded

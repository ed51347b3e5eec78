"""Turn the controller's `--store URL` into a Store."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from orka.errors import Invalid
from orka.store.base import Store

if TYPE_CHECKING:
    from orka.store.etcd import EtcdStore

# Each kind of store is imported when a url names it: a scheduler running alone imports this
# module but opens no store, and etcd's client alone is tens of milliseconds of a start.

DEFAULT_DB_NAME = "orka.db"

ACCEPTED = (
    "sqlite:///ABS/PATH.db, sqlite:// (orka.db in the data dir), memory://, "
    "etcd://HOST:PORT[,...][/PREFIX][?ca=&cert=&key=]"
)

_ETCD_OPTIONS = ("ca", "cert", "key", "timeout")


class StoreSettings(Protocol):
    """What a service's configuration says about its store (ControllerConfig, and
    SchedulerConfig for a standby scheduler)."""

    store_url: str
    data_dir: Path
    etcd_ca: Path | None
    etcd_cert: Path | None
    etcd_key: Path | None


def open_configured(config: StoreSettings) -> Store:
    """open_store() with a service configuration's settings."""
    return open_store(
        config.store_url,
        config.data_dir,
        etcd_ca=config.etcd_ca,
        etcd_cert=config.etcd_cert,
        etcd_key=config.etcd_key,
    )


def open_store(
    url: str,
    data_dir: Path,
    *,
    etcd_ca: Path | None = None,
    etcd_cert: Path | None = None,
    etcd_key: Path | None = None,
) -> Store:
    """Build the store `url` names; the caller opens it (`async with open_store(...) as s`).

    An empty url means the default: SQLite in `data_dir`.

    etcd: `etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`; PREFIX (default /orka) roots every key,
    so several clusters can share one etcd. TLS to etcd is on when a CA or client cert is
    given, by the `etcd_*` arguments (the --etcd-ca/--etcd-cert/--etcd-key flags) or the url's
    `ca`, `cert`, `key` query options (absolute file paths); `timeout` (seconds) bounds each call.
    """
    text = url.strip()
    if not text:
        from orka.store.sqlite import SqliteStore

        return SqliteStore(data_dir / DEFAULT_DB_NAME)
    try:
        parts = urlsplit(text)
    except ValueError as exc:
        raise Invalid(f"store url {url!r}: {exc}; accepted: {ACCEPTED}") from exc
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        from orka.store.sqlite import SqliteStore

        return SqliteStore(_sqlite_path(url, parts, data_dir))
    if scheme == "memory":
        if parts.netloc or parts.path or parts.query or parts.fragment:
            raise Invalid(f"store url {url!r}: memory:// takes no host, path or options")
        from orka.store.memory import MemoryStore

        return MemoryStore()
    if scheme == "etcd":
        return _etcd(url, parts, etcd_ca, etcd_cert, etcd_key)
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


def _etcd(
    url: str,
    parts: SplitResult,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
) -> EtcdStore:
    usage = "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"
    if parts.fragment:
        raise Invalid(f"store url {url!r}: etcd:// takes no #fragment; expected {usage}")
    endpoints = [_endpoint(url, e.strip()) for e in parts.netloc.split(",") if e.strip()]
    if not endpoints:
        raise Invalid(f"store url {url!r}: no etcd endpoint; expected {usage}")
    try:
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise Invalid(f"store url {url!r}: bad options: {exc}") from exc
    unknown = sorted(set(query) - set(_ETCD_OPTIONS))
    if unknown:
        raise Invalid(
            f"store url {url!r}: unknown option(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(_ETCD_OPTIONS)}"
        )
    options = {name: values[-1] for name, values in query.items()}
    # Explicit flags win over the url: they are the more specific, per-host setting.
    tls = {
        "ca": ca or _tls_path(url, options, "ca"),
        "cert": cert or _tls_path(url, options, "cert"),
        "key": key or _tls_path(url, options, "key"),
    }
    timeout = 5.0
    if "timeout" in options:
        try:
            timeout = float(options["timeout"])
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise Invalid(f"store url {url!r}: timeout must be a positive number of seconds")
    from orka.store.etcd import DEFAULT_PREFIX, EtcdStore

    prefix = unquote(parts.path) if parts.path.strip("/") else DEFAULT_PREFIX
    try:
        return EtcdStore(endpoints, prefix, timeout=timeout, **tls)
    except Invalid as exc:
        raise Invalid(f"store url {url!r}: {exc.message}") from exc


def _endpoint(url: str, text: str) -> str:
    host, sep, port = text.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not bare or not port.isdigit() or not 0 < int(port) < 65536:
        raise Invalid(f"store url {url!r}: etcd endpoint {text!r} is not HOST:PORT")
    return text


def _tls_path(url: str, options: dict[str, str], name: str) -> Path | None:
    value = options.get(name)
    if value is None:
        return None
    path = Path(value)
    if not path.is_absolute():
        raise Invalid(f"store url {url!r}: {name} must be an absolute path, got {value!r}")
    return path

"""The agent's --pool and --volume-dir (also ORKA_POOL, ORKA_VOLUME_DIR)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orka.agent.service import AgentConfig
from orka.cli.defaults import UsageError
from orka.cli.main import build_parser
from orka.cli.services import _pool, _volume_dir
from orka.errors import Invalid


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ORKA_POOL", "ORKA_VOLUME_DIR"):
        monkeypatch.delenv(name, raising=False)


def flags(*argv: str) -> tuple[str, Path | None]:
    args = build_parser().parse_args(["agent", *argv])
    return _pool(args.pool), _volume_dir(args.volume_dir)


def test_defaults_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert flags() == ("default", None)
    assert flags("--pool", "gpu", "--volume-dir", "/srv/vols") == ("gpu", Path("/srv/vols"))
    monkeypatch.setenv("ORKA_POOL", "fast")
    monkeypatch.setenv("ORKA_VOLUME_DIR", "/data/v")
    assert flags() == ("fast", Path("/data/v"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pool", "Bad_Pool"], "--pool 'Bad_Pool' must be 1-63 lowercase"),
        (["--volume-dir", "rel/dir"], "--volume-dir: 'rel/dir' must be an absolute path"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        flags(*argv)
    assert message in str(info.value)


def test_config_default_volume_dir_and_checks(tmp_path: Path) -> None:
    config = AgentConfig(name="n1", schedulers=["127.0.0.1:1"], data_dir=tmp_path)
    assert (config.pool, config.volume_dir) == ("default", tmp_path / "volumes")
    with pytest.raises(Invalid, match="--pool"):
        AgentConfig(name="n1", schedulers=["127.0.0.1:1"], data_dir=tmp_path, pool="")

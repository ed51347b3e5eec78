from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from orka.cli.defaults import UsageError, client_target
from orka.cli.main import build_parser, main
from orka.errors import Invalid


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("ORKA_CONTROLLER", "ORKA_CERTS", "ORKA_DATA_DIR", "ORKA_CPU_MILLIS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # This machine's /etc/orka/cli.env, if any, is not these tests' business (test_cli_env.py).
    monkeypatch.setenv("ORKA_CLI_ENV", str(tmp_path / "no-cli.env"))


def parse(*argv: str) -> object:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], "127.0.0.1:7443"),
        ({"ORKA_CONTROLLER": "10.0.0.1:9000"}, [], "10.0.0.1:9000"),
        ({"ORKA_CONTROLLER": "10.0.0.1:9000"}, ["--controller", "h:1"], "h:1"),
    ],
)
def test_controller_flag_env_default(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str], expected: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # The default is filled in by client_target (after the CLI env file: test_cli_env.py).
    assert client_target(parse("get", "nodes", *argv))[0] == expected  # type: ignore[arg-type]


def test_certs_default_follows_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert client_target(parse("get", "nodes"))[1] == tmp_path / "home" / ".orka" / "certs"  # type: ignore[arg-type]
    monkeypatch.setenv("ORKA_DATA_DIR", str(tmp_path / "d"))
    assert client_target(parse("get", "nodes"))[1] == tmp_path / "d" / "certs"  # type: ignore[arg-type]
    monkeypatch.setenv("ORKA_CERTS", str(tmp_path / "c"))
    assert client_target(parse("get", "nodes"))[1] == tmp_path / "c"  # type: ignore[arg-type]


def test_typed_env_default_is_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORKA_CPU_MILLIS", "1500")
    assert parse("agent").cpu_millis == 1500  # type: ignore[attr-defined]
    assert parse("agent", "--cpu-millis", "10").cpu_millis == 10  # type: ignore[attr-defined]


def test_certs_init_writes_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d), "--node", "node-1", "--node", "node-2"]) == 0
    for name in (
        "ca.crt",
        "ca/ca.key",
        "admin.crt",
        "admin.key",
        "controller/controller.crt",
        "scheduler/scheduler.crt",
        "agent-node-1/agent-node-1.crt",
        "agent-node-2/agent-node-2.key",
    ):
        assert (d / name).is_file(), name
    assert "wrote" in capsys.readouterr().out
    before = (d / "ca.crt").read_bytes()
    assert main(["certs", "init", "--dir", str(d), "--node", "node-1,node-2"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (d / "ca.crt").read_bytes() == before


def test_certs_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--role", "agent", "--name", "n9"]) == 0
    assert (d / "agent-n9" / "agent-n9.crt").is_file()
    assert main(["certs", "issue", "--dir", str(d), "--role", "boss", "--name", "x"]) == 1
    assert "role" in capsys.readouterr().err


def test_unreachable_controller_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    capsys.readouterr()
    rc = main(["get", "workloads", "--controller", "127.0.0.1:1", "--certs", str(d)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: cannot reach the controller at 127.0.0.1:1")
    assert "Traceback" not in err


def test_missing_certs_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["get", "workloads", "--controller", "127.0.0.1:1", "--certs", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: certs:") and "orka certs init" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["get", "gizmos"], "unknown resource 'gizmos'"),
        (["get", "nodes", "-o", "xml"], "-o/--output"),
        (["get", "nodes", "--controller", "nohostport"], "--controller"),
        (["agent", "--labels", "zone"], "--labels"),
        (["agent", "--labels", "orka.io/node=n1"], "prefix is set by the scheduler only"),
        (["agent", "--labels", "a b=1"], "not a valid label key"),
        (["agent", "--name", "Bad_Name"], "--name"),
        (["agent", "--cpu-millis", "0"], "--cpu-millis"),
        (
            ["agent", "--secret-dir", "relative/dir"],
            "--secret-dir: relative/dir is not an absolute",
        ),
        (
            ["agent", "--secret-dir", "/no/such/dir"],
            "--secret-dir: /no/such/dir is not an absolute",
        ),
        (["agent", "--libvirt-domain-type", "xen"], "--libvirt-domain-type"),
        (["agent", "--workload-user", "no\x00body"], "--workload-user: must be a user"),
        (["agent", "--workload-group", "x" * 100], "--workload-group: must be a user"),
        (["agent", "--cgroup-parent", "orka/../.."], "--cgroup-parent"),
        (["agent", "--host-ip", "my-host"], "--host-ip: 'my-host' is not an IP address"),
        (["agent", "--host-port-range", "30000-20000"], "--host-port-range: host port range"),
        (["get", "endpoints"], "get endpoints: name the workload"),
        (["describe", "endpoints", "web"], "endpoints are listed, not described"),
        (["scheduler", "--heartbeat-interval", "2", "--node-lost-after", "3"], "--node-lost-after"),
        (["scheduler", "--policy", "random"], "--policy"),
        (
            ["scheduler", "--max-heartbeats-per-second", "-5"],
            "--max-heartbeats-per-second: must be 0 (no bound) or more, got -5",
        ),
        (["scheduler", "--max-heartbeats-per-second", "nan"], "got nan"),
        (["scheduler", "--max-heartbeats-per-second", "many"], "'many' is not a number per second"),
        (["scheduler", "--store", "sqlite://"], "cannot elect an active scheduler"),
        (["scheduler", "--store", "memory://"], "cannot elect an active scheduler"),
        (["scheduler", "--store", "zk://x:1"], "--store: 'zk://x:1' cannot elect"),
        (["scheduler", "--election-ttl", "1"], "--election-ttl: must be at least 2"),
        (["scheduler", "--advertise", "h:0"], "--advertise: 'h:0' needs a real port"),
        (["controller", "--listen", "nope"], "--listen"),
        (["controller", "--audit-log", "/dev/null/audit.log"], "--audit-log: cannot write"),
        (["up", "--agents", "0"], "--agents"),
        (["delete", "node", "x"], "only workloads"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err


def test_audit_flags_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse("controller")
    assert (args.audit_log, args.audit_reads) == (None, False)  # type: ignore[attr-defined]
    monkeypatch.setenv("ORKA_AUDIT_LOG", "/var/log/orka/audit.jsonl")
    monkeypatch.setenv("ORKA_AUDIT_READS", "1")
    args = parse("controller")
    assert args.audit_log == "/var/log/orka/audit.jsonl"  # type: ignore[attr-defined]
    assert args.audit_reads is True  # type: ignore[attr-defined]
    assert parse("controller", "--audit-log", "x.log").audit_log == "x.log"  # type: ignore[attr-defined]


def test_secret_dirs_are_a_list(tmp_path: Path) -> None:
    from orka.cli.services import _secret_dirs

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _secret_dirs(None) == []
    assert _secret_dirs(f"{tmp_path / 'a'}, {tmp_path / 'b'}") == [tmp_path / "a", tmp_path / "b"]


def test_agent_driver_flags_become_driver_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from orka.cli.services import _driver_options

    assert _driver_options(parse("agent")) == {"containerd": {}, "libvirt": {"domain_type": "auto"}}
    monkeypatch.setenv("ORKA_LIBVIRT_DOMAIN_TYPE", "qemu")
    args = parse(
        "agent",
        "--containerd-socket",
        "/tmp/c.sock",
        "--containerd-cgroup-parent",
        "/orka-x",
        "--libvirt-uri",
        "qemu:///session",
    )
    assert _driver_options(args) == {
        "containerd": {"socket": "/tmp/c.sock", "cgroup_parent": "/orka-x"},
        "libvirt": {"uri": "qemu:///session", "domain_type": "qemu"},
    }
    assert _driver_options(parse("agent", "--libvirt-domain-type", "kvm"))["libvirt"] == {
        "domain_type": "kvm"
    }
    assert _driver_options(parse("agent", "--containerd-logs", "file"))["containerd"] == {
        "logs": "file"
    }
    with pytest.raises(UsageError, match="--containerd-logs: 'both' is not one of writer, file"):
        _driver_options(parse("agent", "--containerd-logs", "both"))


def test_containerd_file_logs_go_to_one_file(tmp_path: Path) -> None:
    from orka.runtime.containerd import ContainerdDriver

    driver = ContainerdDriver(tmp_path, logs="file")
    assert driver._log_uri("web-1") == (tmp_path / "instances" / "web-1" / "stdout.log").as_uri()
    writer = ContainerdDriver(tmp_path)._log_uri("web-1")
    assert writer == f"binary://{tmp_path / 'logwriter'}"
    with pytest.raises(Invalid, match="containerd logs: 'both' is not one of writer, file"):
        ContainerdDriver(tmp_path, logs="both")


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent", "--cpu-millis", "lots"]) == 2
    assert "--cpu-millis" in capsys.readouterr().err
    assert main([]) == 2


def test_service_checks_cert_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d), "--node", "node-1"]) == 0
    # An agent given a cert of another role must fail before anything starts, naming the file.
    shutil.rmtree(d / "agent-node-1")
    (d / "admin.crt").rename(d / "agent.crt")
    (d / "admin.key").rename(d / "agent.key")
    capsys.readouterr()
    rc = main(["agent", "--name", "node-1", "--certs", str(d), "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "agent.crt has role 'admin'" in err
    capsys.readouterr()
    rc = main(["agent", "--name", "node-2", "--certs", str(d), "--data-dir", str(tmp_path)])
    assert rc == 1


@pytest.mark.parametrize(
    ("argv", "controller", "certs"),
    [
        (["--controller", "h:1", "--certs", "/c", "get", "nodes"], "h:1", "/c"),
        (["get", "nodes", "--controller", "h:1", "--certs", "/c"], "h:1", "/c"),
        (["--controller=h:1", "get", "nodes", "--certs=/c"], "h:1", "/c"),
        (["--certs", "/c", "--identity", "viewer-x", "get", "nodes", "-o", "json"], None, "/c"),
        # Both places: the one after the command wins.
        (["--controller", "a:1", "get", "nodes", "--controller", "b:2"], "b:2", None),
        (["--controller", "a:1", "get", "nodes", "--controller=b:2"], "b:2", None),
        (["--data-dir", "/d", "describe", "node", "n1"], None, None),
    ],
)
def test_global_flags_before_or_after_the_command(
    argv: list[str], controller: str | None, certs: str | None, tmp_path: Path
) -> None:
    args = parse(*argv)
    assert args.command in ("get", "describe")  # type: ignore[attr-defined]
    data_dir = Path("/d") if "--data-dir" in argv else tmp_path / "home" / ".orka"
    assert client_target(args) == (  # type: ignore[arg-type]
        controller or "127.0.0.1:7443",
        Path(certs) if certs else data_dir / "certs",
    )
    if "--identity" in argv:
        assert args.identity == "viewer-x"  # type: ignore[attr-defined]


def test_a_global_flag_the_command_does_not_take_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `--agents 0` would be refused too, so nothing starts even if --certs were taken.
    assert main(["--certs", "/c", "up", "--agents", "0"]) == 2
    assert "unrecognized arguments: --certs /c" in capsys.readouterr().err


def test_history_flag_defaults_are_the_reconcilers() -> None:
    # The CLI spells them out (the reconciler is not imported at start-up): they must agree.
    from orka.controller.reconciler import FINISHED_RETENTION, KEEP_FINISHED

    args = parse("controller")
    assert args.keep_finished == KEEP_FINISHED  # type: ignore[attr-defined]
    assert args.finished_retention == FINISHED_RETENTION  # type: ignore[attr-defined]

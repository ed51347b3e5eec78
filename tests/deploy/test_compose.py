"""docker-compose.yml for real: our own dockerd, the image built from the Dockerfile on a stand-in
base, Debian's docker-compose 1.29 driving it, and the `orka` CLI of the host talking to it.

No registry is reachable, so the Dockerfile's base image (python:3.11-slim) is imported from a
debootstrapped Debian 12 root with python3 and python3-venv (tests/deploy/debian_rootfs.py);
`docker build --network host` lets pip reach the package index. dockerd runs with its own
socket and exec root in a temporary folder, `--iptables=false` and no default bridge, so it
touches no other Docker on the machine; its data root is kept in the test cache
(/var/cache/orka-tests/docker), so the base image and the build's layers survive between runs.

One scenario, the issue's: up -> every service healthy -> 2 nodes READY -> apply from the host
-> stop an agent: its instances RUNNING on the other node within 10 s -> down (timed) -> up:
the workload is back, both nodes schedulable, every replica RUNNING -> down -v.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.debian_rootfs import cache_dir, debian_rootfs, missing_tools

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
BASE_PACKAGES = ["python3", "python3-venv", "python3-pip", "ca-certificates"]
# The host user who owns the checkout, so ./certs after `up` (HOST_UID / HOST_GID left unset:
# certs.sh's default, the checkout's owner).
HOST_ID = 4321
LONG_RUNNING = ("scheduler", "controller", "agent-1", "agent-2")
DOWN_LIMIT = 10.0  # the issue: `down` of the whole cluster under 10 s
MOVE_LIMIT = 10.0


def base_image() -> str:
    """The image the Dockerfile builds FROM (its first FROM line)."""
    match = re.search(r"^FROM\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match, "Dockerfile has no FROM line"
    return match.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def why_no_dockerd() -> str | None:
    if os.geteuid() != 0:
        return "dockerd needs root"
    missing = [t for t in ("dockerd", "docker", "docker-compose") if shutil.which(t) is None]
    missing += missing_tools()
    if missing:
        return f"missing {', '.join(missing)} (scripts/test.sh installs them)"
    return None


@dataclass
class Docker:
    env: dict[str, str]

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            args,
            env=self.env,
            capture_output=True,
            timeout=timeout,
            input=input.decode() if input is not None else None,
            text=True,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {proc.returncode}\n{proc.stderr[-3000:]}")
        return proc


@contextlib.contextmanager
def own_dockerd() -> Iterator[Docker]:
    data_root = cache_dir() / "docker"
    data_root.mkdir(parents=True, exist_ok=True)
    # Short paths: the socket's must fit a sockaddr_un. One dockerd per data root at a time.
    run_dir = Path(tempfile.mkdtemp(prefix="orka-dockerd-", dir="/tmp"))
    with open(cache_dir() / "docker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = run_dir / "docker.sock"
        log = open(run_dir / "dockerd.log", "wb")
        daemon = subprocess.Popen(
            [
                "dockerd",
                "--iptables=false",
                "--ip-masq=false",
                "--bridge=none",  # compose makes its own network; docker0 stays untouched
                "--data-root",
                str(data_root),
                "--exec-root",
                str(run_dir / "exec"),
                "--pidfile",
                str(run_dir / "dockerd.pid"),
                "--host",
                f"unix://{sock}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "ORKA_"))}
        env.update(DOCKER_HOST=f"unix://{sock}", DOCKER_BUILDKIT="0")
        docker = Docker(env)
        try:
            deadline = time.monotonic() + 60
            while docker.run("docker", "info", check=False, timeout=30).returncode != 0:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    tail = (run_dir / "dockerd.log").read_text()[-2000:]
                    pytest.fail(f"dockerd did not start:\n{tail}")
                time.sleep(0.5)
            yield docker
        finally:
            daemon.terminate()
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
            log.close()
            # dockerd leaves its default network namespace bind-mounted in the exec root.
            for netns in (run_dir / "exec" / "netns").glob("*"):
                subprocess.run(["umount", str(netns)], capture_output=True, check=False)
            shutil.rmtree(run_dir, ignore_errors=True)


def build_image(docker: Docker) -> None:
    base = base_image()
    if docker.run("docker", "image", "inspect", base, check=False).returncode != 0:
        root = debian_rootfs("docker-base", BASE_PACKAGES)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "import", "-", base], stdin=tar.stdout, env=docker.env, check=True,
            capture_output=True, timeout=300,
        )  # fmt: skip
        assert tar.wait(60) == 0
    # The build stage tagged too: its layers (the pinned dependencies, the slow part) are then
    # no dangling images, so the prune below keeps them for the next run.
    build = ("docker", "build", "--network", "host")
    docker.run(*build, "--target", "build", "-t", "orka-build:cache", str(REPO), timeout=600)
    docker.run(*build, "-t", "orka:dev", str(REPO), timeout=600)
    # Layers of earlier builds of changed sources: the cache keeps only what the next run uses.
    docker.run("docker", "image", "prune", "-f")


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r})")


class Project:
    def __init__(self, docker: Docker, dir: Path, api: str) -> None:
        self.docker = docker
        self.dir = dir
        self.api = api
        self.name = f"orkat{os.getpid()}"
        self.env = {
            **docker.env,
            "COMPOSE_PROJECT_NAME": self.name,
            "ORKA_API_PUBLISH": api,
        }

    def compose(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["docker-compose", *args],
            cwd=self.dir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}:\n{proc.stderr[-3000:]}")
        return proc

    def health(self) -> dict[str, str]:
        states = {}
        for service in LONG_RUNNING:
            cid = self.compose("ps", "-q", service).stdout.strip()
            if not cid:
                states[service] = "absent"
                continue
            fmt = "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}"
            states[service] = self.docker.run("docker", "inspect", "-f", fmt, cid).stdout.strip()
        return states

    def wait_healthy(self, timeout: float = 90) -> None:
        def healthy() -> dict[str, str] | None:
            states = self.health()
            return states if all(s == "healthy" for s in states.values()) else None

        wait_for("every service healthy", healthy, timeout, every=1)

    def orka(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The host's `orka` (this venv's) with the admin pair compose wrote into ./certs."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORKA_")}
        proc = subprocess.run(
            ["orka", *args, "--controller", self.api, "--certs", str(self.dir / "certs")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"orka {' '.join(args)}: {proc.stdout}{proc.stderr}")
        return proc

    def get(self, what: str) -> list[dict[str, Any]]:
        proc = self.orka("get", what, "-o", "json", check=False)
        if proc.returncode != 0:
            return []
        items = json.loads(proc.stdout)
        return items if isinstance(items, list) else items.get("items", [])


def _nodes(project: Project) -> dict[str, tuple[str, bool]]:
    return {n["name"]: (n["state"], n["schedulable"]) for n in project.get("nodes")}


def _running(project: Project) -> dict[str, str]:
    """RUNNING instances of the workload `hello`: name -> node."""
    return {
        i["name"]: i["node"]
        for i in project.get("instances")
        if i["workload"] == "hello" and i["phase"] == "RUNNING"
    }


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    why = why_no_dockerd()
    if why is not None:
        pytest.skip(f"cannot run dockerd here: {why}")
    with own_dockerd() as d:
        yield d


@pytest.fixture
def project_dir() -> Iterator[Path]:
    """Outside pytest's tmp dirs (0700 root): the host user must reach ./certs."""
    top = Path(tempfile.mkdtemp(prefix="orka-compose-"))
    top.chmod(0o755)
    try:
        yield top / "project"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_compose_cluster_from_up_to_down(docker: Docker, project_dir: Path) -> None:
    started = time.monotonic()
    build_image(docker)
    built = time.monotonic() - started
    (project_dir / "deploy/compose").mkdir(parents=True)
    shutil.copy(REPO / "docker-compose.yml", project_dir)
    shutil.copy(REPO / "deploy/compose/certs.sh", project_dir / "deploy/compose")
    for path in (project_dir, *project_dir.rglob("*")):
        os.chown(path, HOST_ID, HOST_ID)
    project = Project(docker, project_dir, f"127.0.0.1:{free_port()}")
    ready = {"node-1": ("READY", True), "node-2": ("READY", True)}
    figures: dict[str, float] = {"build": built}
    try:
        t = time.monotonic()
        project.compose("up", "-d", "--no-build")
        project.wait_healthy()
        figures["up"] = time.monotonic() - t
        wait_for("2 nodes READY", lambda: _nodes(project) == ready, 30)

        # Least privilege: each container sees ca.crt and its own pair, nothing else; the
        # controller and scheduler are not root; ./certs is the host user's.
        for service, stem, uid in (
            ("controller", "controller", "10001"),
            ("scheduler", "scheduler", "10001"),
            ("agent-1", "agent-node-1", "0"),
        ):
            out = project.compose("exec", "-T", service, "sh", "-c", "id -u; ls /certs").stdout
            who, *files = out.split()
            assert (who, sorted(files)) == (uid, sorted(["ca.crt", f"{stem}.crt", f"{stem}.key"]))
        certs = project_dir / "certs"
        for path in (certs, certs / "admin.key", certs / "ca" / "ca.key"):
            st = path.stat()
            assert (st.st_uid, st.st_gid) == (HOST_ID, HOST_ID), path
        as_host_user = ["setpriv", f"--reuid={HOST_ID}", f"--regid={HOST_ID}", "--clear-groups"]
        key = subprocess.run([*as_host_user, "cat", str(certs / "admin.key")], capture_output=True)
        assert key.returncode == 0 and key.stdout.startswith(b"-----BEGIN"), key.stderr

        project.orka("apply", "-f", str(REPO / "examples/hello.yaml"), "--wait")
        before = wait_for("3 replicas RUNNING", lambda: len(r := _running(project)) == 3 and r, 30)
        assert set(before.values()) == {"node-1", "node-2"}, before  # spread over both

        t = time.monotonic()
        project.compose("stop", "agent-1")
        wait_for(
            "every replica RUNNING on node-2",
            lambda: set((r := _running(project)).values()) == {"node-2"} and len(r) == 3,
            MOVE_LIMIT,
        )
        figures["move"] = time.monotonic() - t

        t = time.monotonic()
        project.compose("down")
        figures["down"] = time.monotonic() - t

        t = time.monotonic()
        project.compose("up", "-d", "--no-build")
        project.wait_healthy()
        figures["up again"] = time.monotonic() - t
        assert [w["spec"]["name"] for w in project.get("workloads")] == ["hello"]
        wait_for("3 replicas RUNNING again", lambda: len(_running(project)) == 3, 30)
        # Both nodes back and schedulable: a leave's drain must not outlive the restart.
        wait_for("both nodes READY and schedulable", lambda: _nodes(project) == ready, 15)
    finally:
        t = time.monotonic()
        # Cleanup: quick stop (the timed `down` is above); volumes and network go.
        project.compose("down", "-v", "--timeout", "5")
        figures["down -v"] = time.monotonic() - t
        figures["total"] = time.monotonic() - started
        print("compose figures (s):", {k: round(v, 1) for k, v in figures.items()})
    label = f"label=com.docker.compose.project={project.name}"
    left = docker.run("docker", "volume", "ls", "-q", "--filter", label).stdout
    assert left.strip() == ""
    # The host user can remove what compose wrote for them.
    subprocess.run([*as_host_user, "rm", "-rf", str(certs)], check=True, capture_output=True)
    assert not certs.exists()
    assert figures["down"] < DOWN_LIMIT, f"docker-compose down took {figures['down']:.1f}s"

#!/usr/bin/env bash
# The one command that runs the whole test suite, on a fresh Debian 12 machine (as root) or on a
# developer's machine (apt is skipped when not root or when every package is already present).
#
#   ./scripts/test.sh [pytest args...]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv"

stage() { printf '\n==> %s\n' "$*"; }

# --- System packages the tests need ------------------------------------------------------------
# Add packages here as drivers gain real tests (etcd-server, containerd, runc, busybox-static,
# libvirt-daemon-system, libvirt-clients, qemu-system-x86, ...).
APT_PACKAGES=(
  python3-venv
  procps
  # The containerd driver's tests: real containerd + runc, busybox for the test image.
  containerd
  runc
  busybox-static
  # The instance network (orka.runtime.network): the CNI plugins, ip netns/link, iptables.
  containernetworking-plugins
  iproute2
  iptables
  # The libvirt driver's tests: real libvirtd + virtlogd, QEMU (TCG when there is no KVM),
  # libvirt-python's build deps, and busybox for the guest's initramfs.
  libvirt-daemon-system
  libvirt-clients
  qemu-system-x86
  qemu-utils
  libvirt-dev
  pkg-config
  gcc
  busybox-static
  etcd-server
  # The deploy tests (tests/deploy): debootstrap builds a Debian 12 root for both; the systemd
  # test boots it with systemd-nspawn; the compose test runs its own dockerd and Debian's
  # docker-compose 1.29 on a stand-in base image imported from it.
  debootstrap
  systemd-container
  docker.io
  docker-compose
)
# buf (proto lint and breaking checks) comes from npm. Debian's npm only where there is none:
# NodeSource's nodejs bundles npm and conflicts with Debian's npm package.
if ! command -v npm >/dev/null 2>&1; then
  APT_PACKAGES+=(nodejs npm)
fi
# -----------------------------------------------------------------------------------------------

missing_packages() {
  local pkg
  for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg -s "$pkg" >/dev/null 2>&1; then
      echo "$pkg"
    fi
  done
}

stage "system packages"
if ! command -v dpkg >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "no dpkg/apt-get here; skipping system packages (need: ${APT_PACKAGES[*]})"
else
  mapfile -t MISSING < <(missing_packages)
  if [ "${#MISSING[@]}" -eq 0 ]; then
    echo "all present: ${APT_PACKAGES[*]}"
  elif [ "$(id -u)" -ne 0 ]; then
    echo "not root; skipping apt. Missing: ${MISSING[*]}" >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${MISSING[@]}"
  fi
fi

stage "python virtualenv"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "$PYTHON not found on PATH; Orka needs Python >= 3.11" >&2
    exit 1
  fi
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "$("$PYTHON" --version 2>&1) is too old; Orka needs Python >= 3.11" >&2
    exit 1
  fi
  echo "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
else
  echo "using $VENV ($("$VENV/bin/python" --version 2>&1))"
fi

stage "pip install -e '.[dev]'"
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'

# Byte-compiled once here: the tests start hundreds of `orka` processes, and where
# PYTHONDONTWRITEBYTECODE is set each would compile the package's sources again.
"$VENV/bin/python" -m compileall -q orka

stage "ruff check"
"$VENV/bin/ruff" check .

stage "ruff format --check"
"$VENV/bin/ruff" format --check .

stage "generated API is up to date"
"$VENV/bin/python" scripts/gen_api.py --check

stage "buf lint, buf breaking (npm ci: @bufbuild/buf from package-lock.json)"
npm ci --no-audit --no-fund --loglevel=error
"$VENV/bin/python" scripts/buf_check.py --buf "$ROOT/node_modules/.bin/buf" --against HEAD~1

stage "pytest $*"
# The venv first on PATH, so tests find grpcurl and the orka command.
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest "$@"

if [ "$#" -eq 0 ]; then
  # The whole suite: also mutation-test the core functions changed since the recorded run
  # (tests/mutation/baseline.json); a full run takes hours, this takes minutes or nothing.
  stage "mutation testing of changed core functions"
  PATH="$VENV/bin:$PATH" "$VENV/bin/python" scripts/mutation.py --changed
fi

stage "all passed"

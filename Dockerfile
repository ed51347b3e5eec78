# One image for every Orka service; the command picks which (see docker-compose.yml).
#
# Two stages: `build` makes a virtualenv in /opt/orka with every dependency at the exact
# version of constraints.txt (regenerate with `python scripts/lock.py`), then orka itself
# without touching the index again; the final stage copies only that venv onto a fresh base,
# with procps (`ps`, `top`) for looking inside a running service.
#
# The base is python:3.11-slim (Debian 12 with CPython 3.11). Nothing here needs more of it
# than `python3` with venv on PATH and apt, so a Debian 12 root with python3 and python3-venv
# from Debian stands in for it where no registry is reachable (tests/deploy/test_compose.py
# imports one under this name). Plain Dockerfile syntax: Debian's docker.io builds it with or
# without BuildKit.
#
# Users: the image runs as `orka` (uid/gid 10001), which the controller and scheduler keep;
# /data belongs to it, so a new named volume mounted there does too. The agent runs as root
# (compose sets `user: root`): its drivers may need it (containerd's socket, cgroups, VMs).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/orka
# Dependencies first, in their own layer: source edits do not reinstall them.
COPY constraints.txt /src/constraints.txt
RUN /opt/orka/bin/pip install --require-virtualenv -r /src/constraints.txt
COPY pyproject.toml README.md /src/
COPY proto /src/proto
COPY orka /src/orka
# setuptools comes pinned from constraints.txt: no build isolation, no second download.
# `pip check` fails the build when pyproject.toml gained a dependency that constraints.txt
# lacks (run scripts/lock.py), instead of an image that fails at start.
RUN /opt/orka/bin/pip install --require-virtualenv --no-deps --no-build-isolation \
        -c /src/constraints.txt /src \
    && /opt/orka/bin/pip check \
    && /opt/orka/bin/orka --help >/dev/null

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/orka/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends procps \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 orka \
    && useradd --system --uid 10001 --gid orka --home-dir /data --no-create-home \
        --shell /usr/sbin/nologin orka \
    && mkdir -p /data /certs \
    && chown orka:orka /data
COPY --from=build /opt/orka /opt/orka
USER orka
WORKDIR /data
# The probe compose's health checks run: `orka health ADDR --certs /certs` (see there).
ENTRYPOINT ["orka"]
CMD ["--help"]

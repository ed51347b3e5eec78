"""`secret_env_files`: secret values an agent reads from files on its own node at each start.

The value never crosses the network nor lands in a store or state file: the spec names only
the path, and the agent reads it just before the driver starts the instance (so a restart
picks up a rotated file). The agent runs with more rights than its workloads, so it reads only
inside the directories its operator allows (`--secret-dir`); symbolic links are resolved
first, so one cannot point outside them (at the agent's key, say).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from orka.errors import RuntimeFailure
from orka.models import MAX_SECRET_VALUE_BYTES, WorkloadSpec


class SecretFiles:
    def __init__(self, dirs: Iterable[Path] = ()) -> None:
        self.dirs = [Path(os.path.realpath(d)) for d in dirs]

    def resolve(self, spec: WorkloadSpec) -> WorkloadSpec:
        """`spec` with the files' contents added to secret_env. Blocking: call it in a thread.

        One trailing newline is dropped (`echo pw > file` writes one); raises RuntimeFailure
        naming the key and path, never the content."""
        if not spec.secret_env_files:
            return spec
        if not self.dirs:
            raise RuntimeFailure(
                "secret_env_files: this node reads no secret files (its agent has no --secret-dir)"
            )
        values = {key: self._read(key, path) for key, path in spec.secret_env_files.items()}
        # Resolved: the values join secret_env and the references go (a spec naming a key in
        # both would not validate).
        return spec.model_copy(
            update={"secret_env": {**spec.secret_env, **values}, "secret_env_files": {}}
        )

    def _read(self, key: str, path: str) -> str:
        where = f"secret_env_files[{key}]: {path}"
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(d) for d in self.dirs):
            allowed = ", ".join(str(d) for d in self.dirs)
            raise RuntimeFailure(f"{where} is not inside the agent's --secret-dir ({allowed})")
        try:
            # O_NONBLOCK: a FIFO put there must not hang the start; it is refused below.
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as err:
            raise RuntimeFailure(f"{where}: cannot open: {err.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RuntimeFailure(f"{where}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_SECRET_VALUE_BYTES + 2)
        data = data.removesuffix(b"\n")
        if len(data) > MAX_SECRET_VALUE_BYTES:
            raise RuntimeFailure(f"{where}: larger than {MAX_SECRET_VALUE_BYTES} bytes")
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise RuntimeFailure(f"{where}: not UTF-8 text") from None
        if "\0" in text:
            raise RuntimeFailure(f"{where}: contains a NUL byte")
        return text

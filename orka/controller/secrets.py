"""The rule for secret_env values a client sends back redacted.

Get, List and Watch answer every secret_env value with REDACTED, so a client that reads a
workload, changes something and sends it back (`orka get -o yaml` then `orka apply`) sends
REDACTED where the secret was. Such a value means "keep what is stored for this key"; it is
never stored. A key sent with REDACTED that has no stored secret (any Create, or an Update
adding the key) is refused: it is surely a copy of someone else's output, not a secret.
A key left out of an Update is removed, as with env.
"""

from __future__ import annotations

from orka.errors import Invalid
from orka.models import REDACTED, WorkloadSpec


def keep_redacted(old: WorkloadSpec | None, new: WorkloadSpec) -> WorkloadSpec:
    """`new` with each REDACTED secret value replaced by the stored one from `old`."""
    redacted = [key for key, value in new.secret_env.items() if value == REDACTED]
    if not redacted:
        return new
    stored = old.secret_env if old is not None else {}
    missing = [key for key in redacted if key not in stored]
    if missing:
        raise Invalid(
            f"spec.secret_env: {missing[0]!r} is {REDACTED!r}, which keeps a stored secret,"
            " but none is stored under that key; send the value itself",
            field="spec.secret_env",
        )
    merged = {k: stored[k] if v == REDACTED else v for k, v in new.secret_env.items()}
    return new.model_copy(update={"secret_env": merged})

"""orka/api/ must be exactly what scripts/gen_api.py generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_api_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_api.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (
        "orka/api/ is stale; run `python scripts/gen_api.py`\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )

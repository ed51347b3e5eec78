"""The long chaos soak: a real cluster under random faults, its invariants checked throughout.

A 3-member etcd, two controllers, the schedulers and five agents running real processes, as
`tests/e2e/test_chaos.py` runs for about two minutes in CI; here for `--minutes` (30 by
default). Prints the faults injected (by kind and role), the requests and their outcomes, the
checker's samples and every violation; exits 1 if there was one.

    .venv/bin/python bench/bench_chaos.py [--minutes 30] [--seed 7] [--schedulers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit
from orka.security.issue import init_certs
from tests.chaos.soak import SoakConfig, soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--agents", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a 20-second soak")
    parser.add_argument("--keep", type=Path, help="keep certs, data and logs in this dir")
    args = parser.parse_args()
    seconds = 20.0 if args.smoke else args.minutes * 60
    config = SoakConfig(
        seconds=seconds, seed=args.seed, schedulers=args.schedulers, agents=args.agents
    )
    with tempfile.TemporaryDirectory(prefix="orka-chaos-") as tmp:
        base = args.keep or Path(tmp)
        certs = base / "certs"
        init_certs(certs, nodes=[f"node-{i}" for i in range(1, args.agents + 1)])
        report = asyncio.run(soak(certs, base / "data", config))
    print("\n".join(report.lines()), flush=True)
    emit({"bench": "chaos", **report.as_dict()})
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())

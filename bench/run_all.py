"""Run every benchmark, print a summary with each figure as a ratio to the raw echo baseline.

    .venv/bin/python bench/run_all.py            # full sizes, under 10 minutes
    .venv/bin/python bench/run_all.py --smoke    # tiny sizes, under a minute (CI)

Each benchmark is its own subprocess (so one crash does not hide the others' figures) and ends
with a JSON line; the last line printed here is one JSON object with all of them, the machine,
the ratios and which targets hold.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PYTHON, agents_nice, last_json

HERE = Path(__file__).resolve().parent
# Label -> script (bench_<script>.py) and the arguments of its full-size run. A smoke run
# gives each script only --smoke, and skips the labels that exist only for their size.
BENCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "echo": ("echo", ()),
    "decisions": ("decisions", ()),
    # The controller's reconcile passes alone over a burst's writes (in-process, no services).
    "reconcile": ("reconcile", ()),
    "placement": ("placement", ()),
    # Placement at the heartbeat benchmark's node count (issue 18: >= 1,500 /s, no node
    # leaving READY), where retries that ranked every node once overran the scheduler.
    "placement_5000_nodes": ("placement", ("--nodes", "5000", "--no-etcd", "--paced-rate", "0")),
    # Scheduler SIGKILL + restart with 1,000 and 5,000 simulated agents (and the controller's
    # failover), then the active scheduler SIGKILLed beside a standby; full runs only: each
    # size boots etcd, two controllers and the agent hosts, twice.
    "recovery": ("recovery", ("--sizes", "1000,5000", "--standby")),
    "heartbeat": ("heartbeat", ()),
    "healing": ("healing", ()),
    "paging": ("paging", ()),
    "network": ("network", ()),
    "health": ("health", ()),
    "logs": ("logs", ()),
    "volumes": ("volumes", ()),
    # Agents as their own OS processes (`orka agent --runtime fake`), not simulated.
    "agents": ("agents", ()),
    # Invariants under faults, not a speed: a short soak here, the 30-minute one on its own.
    "chaos": ("chaos", ("--minutes", "3")),
}
FULL_ONLY = {"placement_5000_nodes", "recovery", "chaos"}


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psutil
    from google.protobuf.internal import api_implementation

    return {
        "nproc": os.cpu_count(),
        "cpu": model or platform.processor(),
        "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "python": platform.python_version(),
        "protobuf_backend": api_implementation.Type(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run_bench(name: str, smoke: bool) -> dict[str, Any]:
    script, full_args = BENCHES[name]
    args = [PYTHON, str(HERE / f"bench_{script}.py")]
    args += ["--smoke"] if smoke else list(full_args)
    print(f"\n=== {name}: {' '.join(args[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=HERE.parent)
    took = time.perf_counter() - start
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        sys.stdout.write(proc.stderr[-4000:])
        print(f"=== {name}: FAILED (exit {proc.returncode}) after {took:.0f}s", flush=True)
        return {"error": f"exit {proc.returncode}", "seconds": round(took, 1)}
    print(f"=== {name}: {took:.0f}s", flush=True)
    result = last_json(proc.stdout)
    result["wall_s"] = round(took, 1)
    return result


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios to the echo baseline and the issue's targets, where the figures exist."""
    echo = results.get("echo", {}).get("messages_per_s")
    ratios: dict[str, float] = {}
    targets: dict[str, bool] = {}
    dec = results.get("decisions", {}).get("results", {})
    place = results.get("placement", {}).get("sqlite") or {}
    etcd = results.get("placement", {}).get("etcd") or {}
    big = results.get("placement_5000_nodes", {}).get("sqlite") or {}
    hb = results.get("heartbeat", {})
    heal = results.get("healing", {})
    real = results.get("agents", {})

    def ratio(key: str, value: float | None) -> None:
        if echo and value is not None:
            ratios[key] = round(value / echo, 4)

    for policy, figures in dec.items():
        ratio(f"decisions_{policy}_per_echo_msg", figures.get("decisions_per_s"))
        targets[f"decisions_{policy}>=10000/s"] = figures.get("decisions_per_s", 0) >= 10_000
    if "running_per_s" in place:
        ratio("placement_running_per_echo_msg", place["running_per_s"])
        ratio("placement_scheduled_per_echo_msg", place["scheduled_per_s"])
        targets["placement_sqlite>=1000/s"] = place["running_per_s"] >= 1000
        # All 10,000 created in one go: the last waits for the 9,999 before it, so this holds
        # only above ~5,000 placements/s.
        targets["placement_burst_p99<=2s"] = place["p99_create_to_running_s"] <= 2.0
    if "paced_p99_create_to_running_s" in place:
        # Instances created steadily at the placement target's rate (1,000/s by default).
        rate = place["paced_rate_per_s"]
        targets[f"placement_p99<=2s_at_{rate:.0f}/s_paced"] = (
            place["paced_p99_create_to_running_s"] <= 2.0
        )
    if "running_per_s" in big:
        ratio("placement_5000_nodes_running_per_echo_msg", big["running_per_s"])
        targets["placement_5000_nodes_complete_0_not_ready"] = (
            big["complete"] and big["nodes_not_ready_seen"] == 0
        )
        targets["placement_5000_nodes>=1500/s"] = big["running_per_s"] >= 1500
    if "running_per_s" in etcd:
        ratio("placement_etcd_running_per_echo_msg", etcd["running_per_s"])
        targets["placement_etcd>=700/s"] = etcd["running_per_s"] >= 700
    for run in results.get("recovery", {}).get("runs", []):
        agents = run["agents"]
        bound = 3.0 if agents <= 1000 else 6.0
        targets[f"scheduler_restart_{agents}_agents<={bound:.0f}s"] = (
            run["scheduler_restart_to_placement_resumed_s"] <= bound
        )
        targets[f"scheduler_restart_{agents}_agents_0_not_ready"] = (
            run["scheduler_restart_nodes_not_ready_seen"] == 0
        )
        if "standby_failover_to_placement_resumed_s" in run:
            targets[f"standby_failover_{agents}_agents<={bound:.0f}s"] = (
                run["standby_failover_to_placement_resumed_s"] <= bound
            )
            targets[f"standby_failover_{agents}_agents_0_left_ready"] = (
                run["standby_failover_nodes_left_ready"] == 0
            )
    if "running_per_s" in real:
        ratio("real_agents_running_per_echo_msg", real["running_per_s"])
        targets["real_agents>=2000/s"] = real["running_per_s"] >= 2000
    if "heartbeats_per_s" in hb:
        ratio("heartbeats_per_echo_msg", hb["heartbeats_per_s"])
        targets["heartbeat_cpu<60%"] = hb["scheduler_cpu_share"] < 0.6
        targets["heartbeat_rss<1GiB"] = hb["scheduler_peak_rss_mib"] < 1024
        targets["heartbeat_false_not_ready==0"] = hb["false_not_ready"] == 0
    if "kill_to_all_running_elsewhere_s" in heal:
        rtt = results.get("echo", {}).get("rtt_ms_p50")
        if rtt:
            # Healing in units of one echo round trip: how much of it is protocol, not waiting.
            ratios["healing_s_per_echo_rtt"] = round(
                heal["kill_to_all_running_elsewhere_s"] / (rtt / 1e3), 1
            )
        targets["healing<=lost_after+1s"] = (
            heal["kill_to_all_running_elsewhere_s"] <= heal["target_s"]
        )
    return {"ratios": ratios, "targets": targets}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    p.add_argument("--only", nargs="*", choices=list(BENCHES), help="run only these")
    p.add_argument(
        "--agents-nice",
        type=int,
        default=None,
        metavar="0-19",
        help="nice level of the simulated agents' processes (bench/common.py AGENTS_NICE; "
        "default 10, 0: even with the services)",
    )
    args = p.parse_args(argv)
    if args.agents_nice is not None:
        os.environ["ORKA_BENCH_AGENTS_NICE"] = str(args.agents_nice)
    start = time.perf_counter()
    info = machine()
    info["agents_nice"] = agents_nice()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    names = args.only or [n for n in BENCHES if not (args.smoke and n in FULL_ONLY)]
    results = {name: run_bench(name, args.smoke) for name in names}
    summary = summarise(results)
    print("\n=== summary (ratio = figure / raw echo messages per second)")
    for key, value in summary["ratios"].items():
        print(f"  {key:<40} {value}")
    for key, ok in summary["targets"].items():
        print(f"  target {key:<33} {'holds' if ok else 'SHORT'}")
    failed = [name for name, r in results.items() if "error" in r]
    total = round(time.perf_counter() - start, 1)
    print(f"  total {total}s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    print(
        json.dumps(
            {
                "bench": "all",
                "smoke": args.smoke,
                "machine": info,
                "results": results,
                **summary,
                "seconds": total,
                "failed": failed,
            }
        ),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m loadtest.chaos` (`make chaos`): every reliability and security scenario against one loopback
fleet, a verdict table, and docs/reliability.md with the run's figures. Stops every process it started.

    python -m loadtest.chaos                      # the full campaign (30-minute soak), writes docs/reliability.md
    python -m loadtest.chaos --quick              # a smoke run of a few minutes (writes nothing unless --out)
    python -m loadtest.chaos --only soak,security --soak-minutes 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys
import tempfile
import time
import traceback

from loadtest.chaos import report
from loadtest.chaos.common import Options
from loadtest.chaos.fleet import Fleet
from loadtest.chaos.verdict import Verdict

# security last: it scans the logs of everything the campaign sent
SCENARIOS = ("cancel_storm", "replica_death", "router_ha", "redis_outage", "kv_exhaustion", "hostile", "soak",
             "security")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: every scenario, smaller (a few minutes)")
    p.add_argument("--soak-minutes", type=float, default=30.0, help="soak duration (default 30; --quick: 1)")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--out", default=None, help="the report (default docs/reliability.md; none with --quick)")
    p.add_argument("--log-dir", default=None, help="process logs (default: a new temporary directory)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per engine (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    return p


def _heal(fleet: Fleet) -> list[str]:
    """Restart whatever a scenario left dead, so the next one starts from a whole fleet."""
    fixed = []
    if not fleet.redis.ping():
        fleet.redis.start()
        fixed.append("redis")
    for i, e in enumerate(fleet.engines):
        if not e.alive():
            fleet.restart_engine(i)
            fixed.append(e.name)
    for r in fleet.routers:
        if not r.alive():
            r.popen = None
            r.start().wait_ready()
            fixed.append(r.name)
    if fixed:
        fleet.wait_routers_see_engines()
    return fixed


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    names = [s.strip() for s in ns.only.split(",") if s.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or ns.soak_minutes <= 0:
        print(f"loadtest.chaos: unknown scenario(s) {unknown}; choose from {SCENARIOS}" if unknown
              else "loadtest.chaos: --soak-minutes must be > 0", file=sys.stderr)
        return 2
    out = ns.out if ns.out is not None else (None if ns.quick else "docs/reliability.md")
    opts = Options(quick=ns.quick, soak_minutes=ns.soak_minutes, seed=ns.seed)
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="kvfleet-chaos-")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t_start = time.monotonic()
    fleet = Fleet(log_dir, ns.num_blocks)
    verdicts: list[Verdict] = []
    docs: dict[str, str] = {}
    notes: list[str] = list(ns.note)
    print(f"chaos: logs in {log_dir}; starting the fleet ...", flush=True)
    try:
        fleet.start()
        for name in names:
            mod = importlib.import_module(f"loadtest.chaos.{name}")
            docs[mod.NAME] = mod.__doc__ or ""
            print(f"chaos: {mod.NAME} ...", flush=True)
            t0 = time.monotonic()
            try:
                v = asyncio.run(mod.run(fleet, opts))
            except Exception as e:  # a scenario that breaks is a failed scenario, and the campaign goes on
                v = Verdict(mod.NAME)
                v.check("scenario ran to its end", False, f"{type(e).__name__}: {e}")
                traceback.print_exc()
            v.seconds = time.monotonic() - t0
            verdicts.append(v)
            print(f"chaos: {v.scenario}: {'PASS' if v.passed else 'FAIL'} ({v.seconds:.0f} s)", flush=True)
            for c in v.checks:
                print(f"    {'ok  ' if c.passed else 'FAIL'} {c.name}: {c.detail}", flush=True)
            healed = _heal(fleet)
            if healed:
                notes.append(f"after {v.scenario}: restarted {', '.join(healed)}")
    except KeyboardInterrupt:
        print("chaos: interrupted", file=sys.stderr)
        notes.append("interrupted before every scenario ran")
    finally:
        fleet.stop()
    print("\n" + report.table(verdicts), flush=True)
    if out and verdicts:
        cmd = "python -m loadtest.chaos" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
        if ns.quick:
            notes.append("--quick: smaller scenarios (200 cancellation-storm requests, 2 replica deaths, 1,000 fuzzed "
                         "bodies, a 1-minute soak)")
        elif ns.soak_minutes != 30:
            notes.append(f"the soak ran {ns.soak_minutes:g} minutes, not the 30 the campaign asks for; the full "
                         "run is `make chaos` (`python -m loadtest.chaos --soak-minutes 30`)")
        report.write(out, verdicts, docs, cmd, started, time.monotonic() - t_start, notes)
        print(f"chaos: wrote {out}", flush=True)
    return 0 if verdicts and all(v.passed for v in verdicts) and len(verdicts) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())

"""CPU use of every Python process over an interval, from /proc (no tools needed on the device).

Tells a process pinned at one core (GIL-bound) from one with room to spare, e.g. the HTTP worker
and each engine core of a copies server under load:

  python3 bench/proc_cpu.py --after 8 --interval 5
"""

from __future__ import annotations

import argparse
import os
import time


def _sample() -> dict[int, tuple[int, int, int, str]]:
    """pid -> (ppid, utime+stime ticks, threads, short command line) for Python processes."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "python" not in cmd and "gunicorn" not in cmd:
            continue
        # fields[0] is the state; ppid is field 4 of stat (index 1 here), utime/stime 14/15, threads 20
        out[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[17]), cmd[:90])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--after", type=float, default=0.0, help="wait this long before sampling (s)")
    ap.add_argument("--interval", type=float, default=5.0)
    args = ap.parse_args()
    time.sleep(args.after)
    tick = os.sysconf("SC_CLK_TCK")
    a = _sample()
    time.sleep(args.interval)
    b = _sample()
    rows = []
    for pid, (ppid, ticks, threads, cmd) in b.items():
        if pid in a:
            rows.append(((ticks - a[pid][1]) / tick / args.interval * 100, pid, ppid, threads, cmd))
    for cpu, pid, ppid, threads, cmd in sorted(rows, reverse=True)[:12]:
        print(f"{cpu:6.0f}% pid {pid:>7} ppid {ppid:>7} threads {threads:>5}  {cmd}")


if __name__ == "__main__":
    main()

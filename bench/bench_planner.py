"""Planning speed: `polyshard plan` on the largest presets, each in a fresh process.

    python bench/bench_planner.py
    python bench/bench_planner.py --case pangu-alpha-2.6b:8xA100-80G --repeats 3

For each case a new Python process imports the command line (which loads torch only once a
command needs it), then plans the model twice: the first plan ("cold") also pays for loading torch
and what torch loads lazily on first use (torch._dynamo, which its meta kernels import, about 0.7 s
here); the second ("warm") is the planner alone. Each plan is what
`polyshard plan --model M --cluster C` does: build on meta, capture, search every mesh split,
and render the answer, which may be that the model does not fit (the planner's answer then says by
how much). ratio = warm seconds / the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CASES = {  # model:cluster -> target seconds
    "gpt3-175b:128x8xA100-80G": 10.0,
    "pangu-alpha-200b:256x8xA100-80G": 10.0,
    "pangu-alpha-2.6b:8xA100-80G": 1.0,
}

_CHILD = """
import contextlib, io, json, sys, time
t0 = time.perf_counter()
from polyshard.cli.main import main
imported = time.perf_counter() - t0
model, cluster = sys.argv[1].split(":")
times, out = [], io.StringIO()
for _ in range(2):
    t = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["plan", "--model", model, "--cluster", cluster])
    times.append(time.perf_counter() - t)
answer = next((l for l in out.getvalue().splitlines() if "does not fit" in l or l.startswith("chosen")), "")
print(json.dumps({"import_s": imported, "cold_s": times[0], "warm_s": times[1], "exit": code, "answer": answer}))
"""


def run_case(case: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, case], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", metavar="MODEL:CLUSTER",
                   help=f"a case to time (repeatable; default: {', '.join(CASES)})")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per case; medians are shown")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    print("| model | cluster | import s | cold plan s | warm plan s | target s | warm / target | answer |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for case in args.case or CASES:
        start = time.perf_counter()
        runs = [run_case(case) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "cold_s", "warm_s")}
        target = CASES.get(case, float("nan"))
        model, cluster = case.split(":")
        print(f"| {model} | {cluster} | {med['import_s']:.2f} | {med['cold_s']:.2f} | {med['warm_s']:.2f} "
              f"| {target:g} | {med['warm_s'] / target:.2f} | {runs[-1]['answer'][:90]} |", flush=True)
        print(json.dumps({"bench": "planner", "case": case, **med, "target_s": target,
                          "wall_s": time.perf_counter() - start}), file=sys.stderr)


if __name__ == "__main__":
    main()

"""What goodput accounting costs the training loop: the event log (model/runtime/goodput.py EventLog.row
and a save event, once per log interval, with the goodput/* of the whole run so far; the beat,
every step) and the
per-host gather of (data wait, step time) (model/runtime/distributed.py gather_over_hosts, once per
interval) against the all-gather it replaced (max_over_hosts), on 2 local jax.distributed
processes. Prints one JSON line; per step = per interval / log_every.

    python scripts/bench/bench_goodput.py [--past-intervals 20000] [--log-every 10]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench_event_log(past_intervals: int, n: int) -> dict:
    from model.runtime import goodput

    with tempfile.TemporaryDirectory() as d:
        # A run with history: 3 earlier lives of past_intervals / 3 rows each.
        lines, t = [], time.time() - 4 * past_intervals
        for _ in range(3):
            lines += [{"event": "start", "t": t}, {"event": "restore", "t": t + 1, "step": 0, "tier": "latest",
                                                   "seconds": 1.0}, {"event": "compile", "t": t + 2, "step": 1}]
            t += 2
            for i in range(past_intervals // 3):
                t += 1.0
                lines.append({"event": "interval", "t": t, "step": 10 * (i + 1), "interval_s": 1.0,
                              "data_wait_s": 0.01, "stall_s": 0.0})
            t += 30
        Path(d, goodput.EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in lines))
        log = goodput.EventLog(from_process_start=False)
        t0 = time.perf_counter()
        log.open(Path(d), enabled=True)
        open_s = time.perf_counter() - t0
        log.add("restore", step=0, tier="latest", seconds=1.0)
        log.add("compile", step=1)
        row = {"interval_s": 1.0, "data_wait_s": 0.01, "stall_s": 0.0, "loss": 3.0}
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            out = log.row({**row, "step": 10 * (i + 1)})
            if i % 10 == 0:
                log.add("save", step=10 * (i + 1), blocked_s=0.01)
            times.append(time.perf_counter() - t0)
        assert "goodput/goodput" in out
        # The beat (EventLog.beat), called every step with one of the step's outputs: a real jax.Array.
        import jax.numpy as jnp
        done = jnp.zeros(())
        done.block_until_ready()
        beats = 20 * n
        t0 = time.perf_counter()
        for i in range(beats):
            log.beat(i, done)
        beat_us = (time.perf_counter() - t0) / beats * 1e6
        exit_t0 = time.perf_counter()
        log.exit("clean", step=10 * n)
        return {"open_s": open_s, "per_interval_us": statistics.median(times) * 1e6, "beat_per_step_us": beat_us,
                "per_interval_p90_us": sorted(times)[int(0.9 * n)] * 1e6,
                "exit_s": time.perf_counter() - exit_t0}


def gather_worker(port: int, pid: int, n: int) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
    from model.runtime.distributed import gather_over_hosts, max_over_hosts

    out = {}
    for name, fn, arg in (("max_over_hosts", max_over_hosts, 0.5), ("gather_over_hosts", gather_over_hosts,
                                                                   [0.5, 0.25])):
        for _ in range(20):
            fn(arg)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn(arg)
            times.append(time.perf_counter() - t0)
        out[name + "_us"] = statistics.median(times) * 1e6
    if pid == 0:
        print(json.dumps(out), flush=True)


def bench_gather(n: int) -> dict:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, "--gather-worker", str(pid), "--port", str(port),
                               "--n", str(n)], env=env, stdout=subprocess.PIPE, text=True) for pid in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    p = argparse.ArgumentParser()
    p.add_argument("--past-intervals", type=int, default=20000)
    p.add_argument("--intervals", type=int, default=2000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.383, help="the tiny model's step (BENCHMARKS.md train step)")
    p.add_argument("--gather-worker", type=int, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args()
    if args.gather_worker is not None:
        gather_worker(args.port, args.gather_worker, args.n)
        return
    log = bench_event_log(args.past_intervals, args.intervals)
    gather = bench_gather(args.n)
    added_gather_us = gather["gather_over_hosts_us"] - gather["max_over_hosts_us"]
    per_step_us = (log["per_interval_us"] + max(0.0, added_gather_us)) / args.log_every + log["beat_per_step_us"]
    print(json.dumps({**log, **gather, "log_every": args.log_every,
                      "per_step_us": per_step_us, "gather_per_step_us": gather["gather_over_hosts_us"] / args.log_every,
                      "frac_of_tiny_step": per_step_us * 1e-6 / args.step_s,
                      "frac_of_tiny_step_with_whole_gather":
                          ((log["per_interval_us"] + gather["gather_over_hosts_us"]) / args.log_every
                           + log["beat_per_step_us"]) * 1e-6 / args.step_s}))


if __name__ == "__main__":
    main()

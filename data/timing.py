"""Where the input time goes: per-stage timers of the input pipeline, and the table that names
the stage bounding it (what Grain's debug mode prints for its own stages, for ours).

Stages, and the thread each runs on (a stage can bound the pipeline only through its thread):
  fetch     waiting on an object store (gs://...:    the reader thread
            requests + transfer, data/readers/objstore.py)
  read      reading + decompression (a record),      the reader thread of each input process
            fetch excluded
  parse     JSON parsing (a record's parse)          the reader thread
  select    data.quality / data.dedup: the signals   the reader thread
            line beside a document read and judged
  tokenize  inside the tokenizer pool's task          the tokenizer threads
  pack      packing rows, copying them into slabs    the reader thread
  ipc       receiving the workers' slabs (this        the host's feed thread
            thread's CPU time inside their next())
  merge     worker slabs back into shard order,       the host's feed thread
            slab -> batch
  h2d       host batch -> global jax.Array            the host's feed thread
Without input workers the reader thread IS the host's feed thread.
Waits are kept apart from work: tokenize_wait (the reader thread blocked on a tokenizer result),
worker_wait (the feed thread blocked on the workers). They confirm the bound, they are not one.

A timer is two perf_counter calls (~100 ns each) per document (read, parse), per chunk
(tokenize, pack) or per batch (the rest), never per token: scripts/bench/bench_input.py reports the
overhead from the counts. Each input process keeps one cumulative dict of seconds; a worker's
travels with every slab it sends. Times are statistics, not data: they are never part of the
saved state, so batches and exact resume do not depend on them, and a restored pipeline counts
from zero (consumers look at differences).
"""
from __future__ import annotations

STAGES = ("fetch", "read", "parse", "select", "tokenize", "pack", "ipc", "merge", "h2d")
WAITS = ("tokenize_wait", "worker_wait")
STAGE_NAMES = {"fetch": "object-store fetch", "read": "read + decompress", "parse": "JSON parse",
               "select": "quality + dedup",
               "tokenize": "tokenize", "pack": "pack", "ipc": "IPC (receive)", "merge": "merge",
               "h2d": "host -> device"}
# Below this busy fraction for every thread, the input is not what limits the run.
UNSATURATED = 0.5
# The threads that run the stages; "reader" and "tokenizer" count one lane per thread.
THREADS = {"reader": ("fetch", "read", "parse", "select", "pack"), "tokenizer": ("tokenize",),
           "host": ("ipc", "merge", "h2d")}


def zero_times(reader_threads: int = 0, tokenizer_threads: int = 0, in_host: bool = False) -> dict:
    """One input process's timers. reader_threads / tokenizer_threads: the lanes it adds (summed
    over processes); in_host: its reader thread is the host's feed thread (no workers)."""
    t = {k: 0.0 for k in STAGES + WAITS}
    t.update(reader_threads=reader_threads, tokenizer_threads=tokenizer_threads,
             in_host=int(in_host))
    return t


# Per-process facts a worker reports beside its timers: the highest is kept, never a sum.
# start_nice: how much nicer than the trainer it already ran when its pipeline started, its spawn
# and imports done (data/workers.py renice_new_workers; 0: they ran at the trainer's priority).
# gc_frozen: the objects its collector no longer walks (data/host.py _freeze_what_is_there).
FACTS = ("start_nice", "gc_frozen")


def add_times(total: dict, part: dict) -> dict:
    """total += part, in place (seconds and lanes alike; FACTS: the highest); returns total."""
    for k, v in part.items():
        total[k] = max(total.get(k, v), v) if k in FACTS else total.get(k, 0) + v
    return total


def sub_times(now: dict, base: dict | None) -> dict:
    """Seconds spent between two snapshots; the lanes are those of `now`."""
    out = dict(now)
    for k in STAGES + WAITS:
        out[k] = now.get(k, 0.0) - (base or {}).get(k, 0.0)
    return out


def summarize(times: dict, wall_s: float) -> dict:
    """Per stage: seconds and share of all stage seconds; per thread: busy = its stages' seconds
    / (its lanes x wall time); the bound: the busiest thread's largest stage."""
    total = sum(times.get(k, 0.0) for k in STAGES) or 1.0
    lanes = {"reader": max(1, times.get("reader_threads", 1)),
             "tokenizer": max(1, times.get("tokenizer_threads", 1)), "host": 1}
    threads = {name: sum(times.get(k, 0.0) for k in stages) for name, stages in THREADS.items()}
    if times.get("in_host"):   # one thread reads, packs and feeds the device
        threads["reader"] += threads.pop("host")
    busy = {name: s / (lanes[name] * wall_s) if wall_s > 0 else 0.0 for name, s in threads.items()}
    bound_thread = max(busy, key=busy.get)
    stages_of = THREADS[bound_thread] + (THREADS["host"] if bound_thread == "reader"
                                         and times.get("in_host") else ())
    return {"seconds": {k: times.get(k, 0.0) for k in STAGES},
            "share": {k: times.get(k, 0.0) / total for k in STAGES},
            "waits": {k: times.get(k, 0.0) for k in WAITS},
            "busy": busy, "lanes": {k: lanes[k] for k in busy},
            "bound": max(stages_of, key=lambda k: times.get(k, 0.0)),
            "bound_thread": bound_thread, "wall_s": wall_s}


def format_table(summary: dict, batches: int) -> str:
    """The per-stage table, then the bound stage in one line."""
    lines = [f"{'stage':<18}{'seconds':>9}{'ms/batch':>10}{'share':>8}   thread"]
    thread_of = {k: name for name, stages in THREADS.items() for k in stages}
    for k in STAGES:
        s = summary["seconds"][k]
        thread = thread_of[k]
        if thread == "host" and "host" not in summary["busy"]:
            thread = "reader"
        lines.append(f"{STAGE_NAMES[k]:<18}{s:>9.2f}{1e3 * s / max(batches, 1):>10.2f}"
                     f"{100 * summary['share'][k]:>7.1f}%   {thread}")
    for k, s in summary["waits"].items():
        lines.append(f"{'(' + k + ')':<18}{s:>9.2f}{1e3 * s / max(batches, 1):>10.2f}")
    busy = ", ".join(f"{name} {100 * b:.0f}% of {summary['lanes'][name]} thread(s)"
                     for name, b in summary["busy"].items())
    lines.append(f"bound: {STAGE_NAMES[summary['bound']]} (busy over {summary['wall_s']:.1f} s: {busy})")
    if max(summary["busy"].values()) < UNSATURATED:
        lines.append("  no input thread is near saturation: the consumer sets the pace, and the "
                     "bound is the stage that would limit a faster one")
    return "\n".join(lines)


def metrics(summary: dict) -> dict:
    """Flat metrics for one log interval: input/<stage>_s, input/<stage>_share,
    input/busy_<thread>, input/bound (the bound stage's name)."""
    row = {}
    for k in STAGES:
        row[f"input/{k}_s"] = summary["seconds"][k]
        row[f"input/{k}_share"] = summary["share"][k]
    for k, s in summary["waits"].items():
        row[f"input/{k}_s"] = s
    for name, b in summary["busy"].items():
        row[f"input/busy_{name}"] = b
    row["input/bound"] = summary["bound"]
    return row

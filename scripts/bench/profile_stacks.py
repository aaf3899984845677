"""Summarize py-spy's collapsed stacks (`py-spy record --format raw [--threads]`): where the
samples went by thread, by function alone (self) and by function with what it calls (inclusive).

  python scripts/bench/profile_stacks.py head_gil.txt --top 15 [--only head_slab]

A sample line is `frame;frame;...;frame COUNT`, the outermost frame first; with --threads the
first frame names the thread. Functions are counted by name and file, not by line.
"""
from __future__ import annotations

import argparse
import collections
import re

_LINE = re.compile(r":\d+\)$")


def parse(path):
    """[(frames, count)] of a collapsed-stacks file."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            out.append((stack.split(";"), int(count)))
    return out


def func(frame: str) -> str:
    """A frame without its line number: `name (file)`."""
    return _LINE.sub(")", frame)


def summarize(samples, top: int, only: str | None = None):
    if only:
        samples = [(fr, n) for fr, n in samples if any(only in f for f in fr)]
    total = sum(n for _, n in samples) or 1
    threads, self_, incl = collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in samples:
        if frames and frames[0].startswith(("thread ", "process ")):
            name = frames[0]
            frames = frames[1:]
            if frames and frames[0].startswith("thread "):   # "process ...;thread ...;..."
                name, frames = frames[0], frames[1:]
            # one line per kind of thread: ids dropped, a pool's numbered threads counted together
            name = re.sub(r"\s*\(0x[0-9a-f]+\)|\s*\(\d+\)", "", name)
            threads[re.sub(r"_\d+$", "_*", name)] += n
        if frames:
            self_[func(frames[-1])] += n
        for f in {func(f) for f in frames}:
            incl[f] += n
    lines = [f"{total} samples" + (f" holding {only!r}" if only else "")]
    for title, c in (("by thread", threads), ("self", self_), ("inclusive", incl)):
        if not c:
            continue
        lines.append(f"-- {title}")
        lines += [f"{100 * n / total:6.1f}%  {name}" for name, n in c.most_common(top)]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--only", default=None, help="only the samples with a frame containing this")
    args = ap.parse_args()
    print(summarize(parse(args.path), args.top, args.only))


if __name__ == "__main__":
    main()

"""Prints, one per line, the `uv pip install` arguments that make uv resolve as this machine's pip
does: pip's configured find-links, constraints and indexes (`pip config list`: files and PIP_*
variables), and pip's rule of taking the best version across every index. CI installs with uv
(~40 s against pip's ~4 min for the same packages) and falls back to pip if uv fails."""
import shlex
import subprocess
import sys

FLAGS = {"find-links": "--find-links", "constraint": "--constraint", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url"}

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
seen = set()
for line in listing.splitlines():
    key, _, value = line.partition("=")
    flag = FLAGS.get(key.rsplit(".", 1)[-1])
    if not flag or not value:
        continue
    for item in shlex.split(shlex.split(value)[0]):     # 'a b' -> a, b (pip's lists are space-separated)
        if (flag, item) not in seen:
            seen.add((flag, item))
            print(flag)
            print(item)
print("--index-strategy")
print("unsafe-best-match")

"""Divergence (train.on_divergence): what a run does when its loss stops being a number.

A step diverged when its loss is not finite, when its update left non-finite parameters (the
parameter norm after an update that was not skipped), or when train.spikes skipped
`train.divergence_skips` updates in a row. The losses are the same on every host (one global
batch), so every host finds the same divergence at the same step without talking.

It is looked for at each log row and before each save (one fetch of the interval's scalars; the
steps themselves are never synced for it), so a saved step never holds a divergence.

- `stop` (the default; with train.stop_on_nan): the run stops with a line naming the steps.
- `rollback`: every host reloads the newest checkpoint before the first bad step and goes on
  with the data from where it is: the batches since that checkpoint (the ones that led there)
  are skipped. Each host writes its data position to
  `<checkpoint.dir>/rollbacks/<step>/<n>/process_<i>-of-<N>.json` with `rollback.json` (what
  diverged, which steps were rolled back), so a later resume from that step starts past those
  batches too (`data_override`), and scripts/show_step.py replays the new timeline from it.
  Process 0 writes the documents of the rolled-back steps to `<run_dir>/rollback-<step>-<n>.txt`
  (scripts/show_step.py --rollback, in the background). Checkpoints at or after the first bad
  step are moved aside (`<step>.diverged-<time>`), never deleted. A divergence that rolls back
  to the same step as the one before stops the run with one line: the same divergence twice in
  a row, whatever the skipped batches held.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROLLBACKS_DIR = "rollbacks"
ON_DIVERGENCE = ("stop", "rollback")


class Diverged(RuntimeError):
    """The run diverged and cannot (or may not) roll back: one line, exit 1."""


@dataclasses.dataclass(frozen=True)
class Divergence:
    first_step: int         # the first bad step
    seen_step: int          # the step at which it was found (a log row or a save)
    reason: str


def find_divergence(metrics: list[dict], last_step: int, skips_in_a_row: int = 0) -> Divergence | None:
    """The first divergence among the (host) metrics of steps last_step - len + 1 .. last_step."""
    first = last_step - len(metrics) + 1
    for i, m in enumerate(metrics):
        step = first + i
        loss = float(m["loss"])
        if not math.isfinite(loss):
            return Divergence(step, last_step, f"loss {loss} at step {step}")
        skipped = float(m.get("skipped", 0.0)) > 0
        norm = float(m.get("param_norm", 0.0))
        if not skipped and not math.isfinite(norm):
            return Divergence(step, last_step, f"the parameters are not finite after step {step} (norm {norm})")
        run = int(m.get("skipped_in_a_row", 0))
        if skips_in_a_row and run >= skips_in_a_row:
            start = step - run + 1
            return Divergence(start, last_step, f"{run} updates in a row skipped as loss spikes "
                                                f"(steps {start}..{step}; train.divergence_skips={skips_in_a_row})")
    return None


def check_settings(on_divergence: str, divergence_skips) -> None:
    if on_divergence not in ON_DIVERGENCE:
        raise ValueError(f"train.on_divergence={on_divergence!r}: one of {', '.join(ON_DIVERGENCE)}")
    if divergence_skips is not None and int(divergence_skips) < 0:
        raise ValueError(f"train.divergence_skips={divergence_skips} must be >= 0 (0: never)")


# ---------------------------------------------------------------- the records on disk
def _records_dir(ckpt_dir: str, step: int):
    from etils import epath  # checkpoint.dir may be gs://

    return epath.Path(ckpt_dir) / ROLLBACKS_DIR / str(step)


def rollbacks_of(ckpt_dir: str, step: int) -> list[dict]:
    """The complete rollback records to `step`, in order (each with "n" and its states' "dir")."""
    root = _records_dir(ckpt_dir, step)
    if not root.is_dir():
        return []
    out = []
    for d in sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        record = d / "rollback.json"
        if record.is_file():
            out.append({**json.loads(record.read_text()), "n": int(d.name), "dir": str(d)})
    return out


def read_states(states_dir: str) -> list[dict]:
    """Every host's data state written by a rollback, in process order."""
    from etils import epath

    d = epath.Path(states_dir)
    files = sorted(d.glob("process_*-of-*.json"), key=lambda f: int(f.name.split("_")[1].split("-")[0]))
    count = {int(f.name.rsplit("-of-", 1)[1][:-len(".json")]) for f in files}
    if not files or len(count) != 1 or len(files) != count.pop():
        raise ValueError(f"incomplete rollback data state in {d}: {[f.name for f in files]}")
    return [json.loads(f.read_text()) for f in files]


def data_override(ckpt_dir: str, step: int) -> tuple[dict, list[dict]] | None:
    """(the newest rollback record to `step`, every host's data state it saved) or None: a
    resume from `step` starts its data there, past the batches rolled back."""
    records = rollbacks_of(ckpt_dir, step)
    if not records:
        return None
    return records[-1], read_states(records[-1]["dir"])


# ---------------------------------------------------------------- the rollback itself
class Rollback:
    """train.on_divergence=rollback for one run: `roll_back` returns the restored state and its
    step, or raises Diverged. Every process calls it at the same step (the divergence is
    found alike everywhere); `barrier()` waits for every host."""

    def __init__(self, ckpt, abstract_state, *, run_dir: Path, process_index: int, process_count: int,
                 barrier: Callable[[], None], resumed_from: int | None = None):
        self.ckpt = ckpt
        self.abstract_state = abstract_state
        self.run_dir = Path(run_dir)
        self.process_index, self.process_count = process_index, process_count
        self.barrier = barrier
        # A start that resumed past an earlier rollback to its step counts it as the one before.
        self.last_target = resumed_from
        self.documents: list[subprocess.Popen] = []
        self.on_rollback: Callable[[int], None] | None = None    # the local tier drops later steps

    def roll_back(self, div: Divergence, consumed_state: dict) -> tuple[dict, int, dict]:
        """(state, step, record) after rolling back past `div`; the data goes on from
        `consumed_state` (this host's position now), which a resume from `step` takes too."""
        from model.runtime.checkpoint import ResumePoint, complete_steps

        self.ckpt.wait()
        directory = self.ckpt.directory
        steps = complete_steps(directory)         # collective (Orbax syncs the hosts): every process
        good = [s for s in steps if s < div.first_step]
        if not good:
            raise Diverged(f"{div.reason}; no checkpoint before step {div.first_step} in {directory} "
                           "to roll back to (train.on_divergence=rollback)")
        target = good[-1]
        twice = self.last_target == target
        before = rollbacks_of(directory, target)
        n = len(before)
        record = {"to_step": target, "first_bad_step": div.first_step, "seen_at_step": div.seen_step,
                  "rolled_back_steps": [target + 1, div.seen_step], "reason": div.reason,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "documents": f"rollback-{target}-{n}.txt", "stopped": twice}
        # Every host's position first, then the record that makes it count (process 0, after all wrote).
        states = _records_dir(directory, target) / str(n)
        states.mkdir(parents=True, exist_ok=True)
        name = f"process_{self.process_index}-of-{self.process_count}.json"
        tmp = states / f".{name}.tmp"
        tmp.write_text(json.dumps(consumed_state))
        tmp.rename(states / name)
        self.barrier()
        if self.process_index == 0:
            (states / ".rollback.json.tmp").write_text(json.dumps(record, indent=1))
            (states / ".rollback.json.tmp").rename(states / "rollback.json")
            self._write_documents(directory, target, n)
        # Steps that hold the divergence (saved before it was seen) are moved aside, never deleted.
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        if self.process_index == 0:
            for s in steps:
                if s >= div.first_step:
                    (states.parent.parent.parent / str(s)).rename(states.parent.parent.parent / f"{s}.diverged-{stamp}")
        if self.on_rollback is not None:
            self.on_rollback(target)
        self.barrier()
        if twice:
            prev = before[-1] if before else {}
            raise Diverged(
                f"twice in a row: {div.reason}, after rolling back to step {target} at step "
                f"{prev.get('seen_at_step', '?')} ({prev.get('reason', '?')}); stopping. A resume from step "
                f"{target} starts past the batches of both (see {states}); the documents of the steps rolled "
                f"back are in {self.run_dir}/rollback-{target}-*.txt")
        self.ckpt.manager.reload()
        state = self.ckpt.restore_state(ResumePoint(directory, target, "latest"), self.abstract_state)
        self.last_target = target
        return state, target, record

    def recover(self, div: Divergence, step: int, batches, *, meter, events, paused, announce: bool):
        """roll_back() from inside the training loop at `step`: the watchdog paused (`paused()`),
        the meter's interval started again, the event logged, one line printed. Returns
        (state, step rolled back to, record)."""
        t0 = time.perf_counter()
        with paused():
            state, target, record = self.roll_back(div, batches.consumed_state())
        meter.rolled_back(batches.stats())
        events.add("rollback", step=target, from_step=step, seconds=time.perf_counter() - t0)
        if announce:
            print(f"diverged: {div.reason}; rolled back to step {target} from step {step}: the data goes on past "
                  f"steps {target + 1}..{step}, whose documents are written to {self.run_dir / record['documents']}",
                  flush=True)
        return state, target, record

    def _write_documents(self, directory: str, target: int, n: int) -> None:
        """scripts/show_step.py --rollback in the background: the rolled-back steps' documents."""
        script = Path(__file__).resolve().parents[2] / "scripts" / "show_step.py"
        out = self.run_dir / f"rollback-{target}-{n}.txt"
        with open(out, "w") as f:
            self.documents.append(subprocess.Popen(
                [sys.executable, str(script), str(self.run_dir), "--rollback", f"{target}/{n}",
                 "--checkpoint-dir", str(directory)],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # A replay on the CPU: never the accelerator the run holds.
                env={**os.environ, "JAX_PLATFORMS": "cpu"}))

    def close(self, timeout_s: float = 600.0) -> None:
        """Waits for the documents being written (they are small next to the run)."""
        for p in self.documents:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


class DivergenceCheck:
    """train.on_divergence in the loop: where a row is logged or a step saved, the steps since the
    last row are looked at (IntervalMeter.divergence). `stop` raises Diverged; `rollback` returns
    the state and step to go on from (Rollback.recover) and adds its record to `rollbacks`, which
    the meta of every later save carries."""

    def __init__(self, meter, rollback: Rollback | None, *, skips: int, rollbacks: list):
        self.meter, self.rollback, self.skips = meter, rollback, skips
        self.rollbacks = rollbacks
        self.enabled = rollback is not None or meter.stop_on_nan

    def check(self, step: int, batches, *, events, paused, announce: bool) -> tuple[dict, int] | None:
        if not self.enabled or (div := self.meter.divergence(step, self.skips)) is None:
            return None
        if self.rollback is None:
            raise Diverged(f"{div.reason}; step {step} is not saved (train.on_divergence=stop; "
                           "rollback reloads the newest checkpoint before it)")
        state, step, record = self.rollback.recover(div, step, batches, meter=self.meter, events=events,
                                                    paused=paused, announce=announce)
        # A new list: a save in flight may still hold the old one in its meta.
        self.rollbacks = [*self.rollbacks, record]
        return state, step

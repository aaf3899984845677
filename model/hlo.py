"""Reading a compiled program's HLO text (`compiled.as_text()`): its computations, how many times
each runs per step, and the bytes of an instruction's shape. Shared by model/dcn.py (what crosses
the data-center network) and model/ici.py (what the collectives move over each mesh axis).

A computation runs once per execution of each instruction that calls it (a fusion, a call, a
reduction's `to_apply`, a conditional's branches), and a while loop's body once per trip: a
scanned layer stack or a microbatch loop multiplies everything inside it by its trip count.
"""
from __future__ import annotations

import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition)=%([^\s,)}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# The opcode: the first word followed by "(" after a blank; a shape's own parentheses (tuples,
# tiling T(8,128) and memory space S(1) inside layouts) never follow a blank and a word.
_OPCODE = re.compile(r"\s([a-z][a-z0-9-]*)\(")
# The second half of an asynchronous pair: its start already called the computation it wraps.
_ASYNC_SECOND_HALF = re.compile(r"(?:-done|-update)$")


def array_bytes(shape_text: str) -> int:
    """Bytes of the first array in `shape_text` (0 for a token or an unknown type)."""
    m = _ARRAY.search(shape_text)
    if not m or m.group(1) not in DTYPE_BYTES:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * DTYPE_BYTES[m.group(1)]


def shape_tree(shape_text: str):
    """The shape as nested lists of its arrays' bytes: "(f32[2], (bf16[4], u32[]))" -> [8, [8, 4]];
    an array alone -> its bytes."""
    text = re.sub(r"/\*.*?\*/", "", re.sub(r"\{[^{}]*\}", "", shape_text))   # layouts, /*index=5*/
    stack: list[list] = [[]]
    for token in re.finditer(r"\(|\)|" + _ARRAY.pattern, text):
        if token.group(0) == "(":
            stack.append([])
        elif token.group(0) == ")":
            if len(stack) > 1:
                inner = stack.pop()
                stack[-1].append(inner)
        else:
            stack[-1].append(array_bytes(token.group(0)))
    top = stack[0]
    return top[0] if len(top) == 1 else top


def total_bytes(tree) -> int:
    """Sum of every array in a shape_tree."""
    return sum(total_bytes(t) for t in tree) if isinstance(tree, list) else tree


def opcode(text: str) -> tuple[str, str] | None:
    """(opcode, result shape text) of an instruction's text after '='; None if there is none."""
    m = _OPCODE.search(text)
    return (m.group(1), text[:m.start()]) if m else None


def parse(hlo: str) -> tuple[dict[str, dict[str, str]], str | None]:
    """{computation: {instruction: its text after '='}} and the entry computation's name."""
    comps: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = {}
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        if line.rstrip() == "}":    # a lone brace: a "}" opening a line may continue an instruction
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            comps[current][m.group(1)] = m.group(2)
    return comps, entry


def _scalar(comp: dict[str, str], name: str, depth: int = 0) -> int | None:
    """The value of an integer scalar that is a constant, or a copy/bitcast of one."""
    text = comp.get(name)
    if text is None or depth > 8:
        return None
    m = re.search(r"\bconstant\((-?\d+)\)", text)
    if m:
        return int(m.group(1))
    m = re.search(r"\b(?:copy|bitcast|convert)\(%([^\s,)]+)\)", text)
    return _scalar(comp, m.group(1), depth + 1) if m else None


def trip_count(comps, caller: str, while_text: str, condition: str) -> int:
    """Trips of a counted loop (i from a constant start while i < a constant limit; XLA may have
    peeled trips off, which then appear beside the loop). 1 when it cannot be read."""
    cond = comps.get(condition, {})
    limit = None
    for text in cond.values():
        m = re.search(r"compare\(%([^\s,)]+), %([^\s,)]+)\), direction=LT", text)
        if m:
            limit = _scalar(cond, m.group(2))
    init = re.search(r"\bwhile\(%([^\s,)]+)\)", while_text)
    start = None
    if init:
        tup = comps[caller].get(init.group(1), "")
        first = re.search(r"\btuple\(%([^\s,)]+)", tup)
        start = _scalar(comps[caller], first.group(1)) if first else None
    if limit is None:
        return 1
    return max(limit - (start or 0), 0)


def executions(comps, entry: str) -> dict[str, int]:
    """{computation: how many times it runs per execution of the entry}; computations never
    called from the entry are absent."""
    calls: dict[str, list[tuple[str, int]]] = {}     # computation -> (callee, runs per run of it)
    for comp, instructions in comps.items():
        calls[comp] = []
        for text in instructions.values():
            op = opcode(text)
            if op and _ASYNC_SECOND_HALF.search(op[0]):
                continue
            callees = _CALLEES.findall(text)
            for branches in _BRANCHES.findall(text):
                callees += [("branch", b.strip().lstrip("%")) for b in branches.split(",") if b.strip()]
            cond = next((n for k, n in callees if k == "condition"), None)
            for kind, name in callees:
                trips = trip_count(comps, comp, text, cond) if kind == "body" and cond is not None else 1
                calls[comp].append((name, trips))
    # Callers before callees (HLO's call graph is acyclic): a computation's count is final once
    # every caller reachable from the entry has added to it.
    reachable, stack = {entry}, [entry]
    while stack:
        for name, _ in calls.get(stack.pop(), []):
            if name not in reachable:
                reachable.add(name)
                stack.append(name)
    waiting = dict.fromkeys(reachable, 0)
    for comp in reachable:
        for name, _ in calls.get(comp, []):
            waiting[name] += 1
    times = {entry: 1}
    ready = [entry]
    while ready:
        comp = ready.pop()
        for name, trips in calls.get(comp, []):
            times[name] = times.get(name, 0) + times[comp] * trips
            waiting[name] -= 1
            if waiting[name] == 0:
                ready.append(name)
    return times


def executed_instructions(hlo_text: str):
    """(computation, instruction text, executions per step) of every instruction of the compiled
    program `hlo_text` (compiled.as_text()); nothing for a text without an entry computation."""
    comps, entry = parse(hlo_text)
    if entry is None:
        return
    times = executions(comps, entry)
    for comp, instructions in comps.items():
        for text in instructions.values():
            yield comp, text, times.get(comp, 0)

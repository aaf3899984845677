"""Docs that stay true: README.md and docs/**/*.md held against the code they describe.

    pytest -n0 tests/test_docs.py                   # everything (the doc-wide checks are slow)
    pytest -n0 tests/test_docs.py -m "not slow"     # the parsers on synthetic markdown, the table

(a) Commands. Every `python scripts/<name>.py ...` and `python train.py ...` in a fenced shell block
    or in inline code (line continuations joined, `# comments` dropped, commands inside quoted
    strings such as `bash -c '...'` or `gcloud ... --command '...'` looked into) is checked:
    each --flag against the script's own argparse options (read from `python scripts/X.py --help`,
    and `X.py SUB --help` for a subcommand such as `tpu.py run`; train.py: Hydra's own flags), and
    each Hydra override (train.py's arguments; `key=value` arguments of scripts that take Hydra
    overrides, e.g. compile_tpu.py; anything after `--` for tpu.py run / launch_local.py) against
    the config composed from configs/ with the command's group choices (experiment=..., model=...)
    and `+key=` additions. Values are never checked (placeholders such as YOUR_BUCKET are fine).
(b) Runnable snippets. A fenced block whose previous non-blank line is `<!-- runnable -->` runs
    and must exit 0: python in a tmp directory with the repo on PYTHONPATH, bash (`set -eo
    pipefail`) in a copy of the repo (so `python train.py` writes its runs/ there, not into your
    checkout) with a tmp HOME.
(c) The experiments table. README's table whose header starts `| experiment |` names every
    configs/experiment/*.yaml (both ways), and its `tokens` column is each experiment's budget,
    train.steps x data.global_batch_size x data.seq_len as Hydra composes it, within the precision
    printed ("4.2B" is 4.15B-4.25B).
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
RUNNABLE = "<!-- runnable -->"
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
PYTHON_LANGS = {"python", "py", "python3"}
SEPARATORS = {"|", "||", "&", "&&", ";", ";;"}
# Scripts whose command line is another program's argparse parser (their --help prints it).
DELEGATED_CLI = {"scripts/run_lm_eval.py"}      # lm_eval's
# What Hydra reads as an override's key: [+|++|~]key.path, list indices and @packages included.
OVERRIDE_KEY = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][\w./@-]*$")
# Never copied for a runnable bash block (the repo copy it runs in).
# A runnable snippet importing one of these runs only where its extra is installed (skips otherwise).
OPTIONAL_IMPORTS = {"torch": "torch", "torchdata": "torch", "transformers": "hf", "lm_eval": "eval"}
COPY_IGNORE = shutil.ignore_patterns(".git", "runs", "outputs", "multirun", "wandb", "__pycache__", ".pytest_cache",
                                     ".ruff_cache", "*.egg-info", ".whl", ".venv", "venv", ".gpu")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------------
# Markdown: code blocks, inline code, tables
# ------------------------------------------------------------------------------------------------
@dataclass
class Block:
    """A fenced code block: its language, its lines with their line numbers, runnable or not."""
    lang: str
    line: int                                   # the opening fence's line (1-based)
    lines: list[tuple[int, str]]
    runnable: bool


FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def split_markdown(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """(fenced blocks, the lines outside them) of a markdown text."""
    blocks, prose = [], []
    lines = text.splitlines()
    i = 0
    previous = ""                               # the last non-blank line outside a block
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        blocks.append(Block(lang, start, body, previous == RUNNABLE))
        previous = ""
        i += 1                                  # the closing fence
    return blocks, prose


INLINE = re.compile(r"(`+)(.+?)\1")


def inline_code(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [(n, m.group(2).strip()) for n, line in prose for m in INLINE.finditer(line)]


def logical_lines(block: Block) -> list[list[tuple[int, str]]]:
    """The block's shell commands: physical lines joined where one ends with a backslash."""
    out, current = [], []
    for n, line in block.lines:
        text = line.strip()
        if block.lang == "console" and text.startswith("$ "):
            text = text[2:]
        if text.endswith("\\"):
            current.append((n, text[:-1]))
            continue
        current.append((n, text))
        out.append(current)
        current = []
    if current:
        out.append(current)
    return out


def tables(text: str) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """Markdown tables outside code blocks: (header line, header cells, [(line, cells), ...])."""
    _, prose = split_markdown(text)
    out, run = [], []
    for n, line in [*prose, (0, "")]:
        if line.lstrip().startswith("|"):
            run.append((n, line))
            continue
        if len(run) >= 2 and re.fullmatch(r"[\s|:-]+", run[1][1]):
            out.append((run[0][0], cells(run[0][1]), [(m, cells(row)) for m, row in run[2:]]))
        run = []
    return out


def cells(row: str) -> list[str]:
    row = row.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)]


# ------------------------------------------------------------------------------------------------
# Commands in code
# ------------------------------------------------------------------------------------------------
@dataclass
class Command:
    script: str                                 # "train.py", "scripts/tpu.py" (repo-relative)
    args: list[str]
    lines: list[tuple[int, str]]                # the physical lines it came from

    def line_of(self, word: str) -> int:
        """The first physical line holding `word` (a flag or a key), else the command's first."""
        return next((n for n, text in self.lines if word in text), self.lines[0][0])


def resolve_script(word: str) -> str | None:
    """The repo-relative script a command word names ("train.py", "scripts/x.py", a bare "x.py" that
    is one of scripts/ or scripts/bench/), else None. A scripts/ path that does not exist is returned
    as written: the check reports it."""
    if not word.endswith(".py") or word.startswith("-") or any(c in word for c in "*?["):
        return None             # not a path to one script (a glob such as scripts/bench/bench_*.py)
    if word == "train.py" or word.endswith("/train.py"):
        return "train.py"
    if "scripts/" in word:
        return word[word.index("scripts/"):]
    if "/" not in word:
        for sub in ("scripts", "scripts/bench"):
            if (REPO / sub / word).is_file():
                return f"{sub}/{word}"
    return None


def shell_words(text: str) -> list[str]:
    """Words of a shell line; a word starting with # ends it (a comment); separators are words."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError:                          # an unbalanced quote (prose in inline code)
        words = text.split()
    for i, w in enumerate(words):
        if w.startswith("#"):
            return words[:i]
    return words


def find_commands(text: str, lines: list[tuple[int, str]]) -> list[Command]:
    """The script commands in one shell line (looking into quoted nested commands as well)."""
    out = []
    segment: list[str] = []
    # $(...) is another command's output: one word standing for it (its options are not ours).
    while (sub := re.sub(r"\$\([^()]*\)", "SUBSTITUTED", text)) != text:
        text = sub
    for word in [*shell_words(text), ";"]:
        if word not in SEPARATORS:
            segment.append(word)
            continue
        for i, w in enumerate(segment):
            script = resolve_script(w)
            if script:
                args = []
                for a in segment[i + 1:]:
                    if a in (">", ">>", "<", "2>", "2>>", "&>") or a.startswith((">", "2>")):
                        break                   # a redirection: the command's arguments end
                    args.append(a)
                out.append(Command(script, args, lines))
                break
        for w in segment:                       # bash -c '...', gcloud ... --command '...'
            if " " in w and ".py" in w:
                out += find_commands(w, lines)
        segment = []
    return out


def doc_commands(text: str) -> list[Command]:
    blocks, prose = split_markdown(text)
    out = []
    for block in blocks:
        if block.lang in SHELL_LANGS:
            for logical in logical_lines(block):
                out += find_commands(" ".join(t for _, t in logical), logical)
    for n, code in inline_code(prose):
        out += find_commands(code, [(n, code)])
    return out


# ------------------------------------------------------------------------------------------------
# What a script accepts: its argparse options (from --help) and whether it takes Hydra overrides
# ------------------------------------------------------------------------------------------------
@dataclass
class CLI:
    flags: dict[str, str] = field(default_factory=dict)       # flag -> "0" | "1" | "?" | "+"
    subcommands: list[str] = field(default_factory=list)
    hydra: bool = False                                        # takes Hydra overrides
    error: str | None = None                                   # --help failed: why


def parse_help(text: str) -> CLI:
    """An argparse help text's options (how many values each takes), subcommands, and whether a
    positional `overrides` (or the usage line) says it takes Hydra overrides."""
    cli = CLI()
    section = ""
    usage = text.split("\n\n", 1)[0]
    cli.hydra = "override" in usage.lower()
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line.lower()
            continue
        m = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if m:
            for part in m.group(1).split(", "):
                name, *values = part.split()
                name, eq, _ = name.partition("=")
                if eq or (values and not values[0].startswith("[")):
                    kind = "+" if any(v.endswith("...]") for v in values) else "1"
                else:
                    kind = "?" if values else "0"
                cli.flags[name] = kind
            continue
        if section.startswith("positional"):
            if (m := re.match(r"^    ([\w-]+)(\s|$)", line)):
                cli.subcommands.append(m.group(1))
            elif (m := re.match(r"^  \{([\w,-]+)\}", line)):
                cli.subcommands += m.group(1).split(",")
            elif re.match(r"^  overrides(\s|$)", line):
                cli.hydra = True
    return cli


@functools.lru_cache(maxsize=None)
def script_cli(script: str, sub: str | None = None) -> CLI:
    """What `script` (or its subcommand `sub`) accepts. train.py: Hydra's own command line."""
    if script == "train.py":
        from hydra._internal.utils import get_args_parser

        # Its help text cannot be formatted outside a Hydra app (lazy help strings): the actions.
        kinds = {0: "0", None: "1", 1: "1", "?": "?"}
        return CLI(flags={s: kinds.get(a.nargs, "+") for a in get_args_parser()._actions for s in a.option_strings},
                   hydra=True)
    if not (REPO / script).is_file():
        return CLI(error=f"{script} does not exist")
    source = (REPO / script).read_text()
    if "ArgumentParser" not in source and script not in DELEGATED_CLI:
        return CLI()            # no command-line options at all (code_shape.py [ROOT]): never run it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, script, *([sub] if sub else []), "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return CLI(error=f"`python {script}{' ' + sub if sub else ''} --help` failed: "
                         f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return parse_help(r.stdout)


def command_cli(cmd: Command) -> tuple[CLI, str]:
    """The options of the command's script, with its subcommand's (tpu.py run ...) when it names one;
    a script with subcommands run without one (lm-eval's legacy form) gets all of theirs."""
    top = script_cli(cmd.script)
    if top.error or not top.subcommands:
        return top, cmd.script
    sub = next((a for a in cmd.args if a in top.subcommands), None)
    subs = [script_cli(cmd.script, s) for s in ([sub] if sub else top.subcommands)]
    merged = CLI(flags=dict(top.flags), hydra=any(s.hydra for s in subs))
    for s in subs:
        if s.error:
            return s, cmd.script
        merged.flags.update(s.flags)
    return merged, f"{cmd.script} {sub}" if sub else cmd.script


def override_like(word: str) -> bool:
    """key=value with a key Hydra could read (not prose such as `=== ... ===`, not a placeholder)."""
    key, eq, _ = word.partition("=")
    return bool(eq) and bool(OVERRIDE_KEY.match(key))


def split_args(cmd: Command, cli: CLI) -> tuple[list[str], list[str]]:
    """(flags, Hydra overrides) of a command, a flag's values skipped by how many it takes."""
    flags, overrides = [], []
    args = cmd.args
    i = 0
    after_dashes = False
    while i < len(args):
        a = args[i]
        i += 1
        if after_dashes:
            if override_like(a):
                overrides.append(a)
        elif a == "--":
            after_dashes = True
        elif a.startswith("-") and len(a) > 1 and not re.fullmatch(r"-[0-9.]+", a):
            name, eq, _ = a.partition("=")
            flags.append(name)
            kind = cli.flags.get(name, "0")
            if eq or kind == "0":
                continue
            if kind == "1":
                i += 1
                continue
            while i < len(args) and not args[i].startswith("-") and "=" not in args[i]:
                i += 1
                if kind == "?":
                    break
        elif cli.hydra and override_like(a):
            overrides.append(a)
    return flags, overrides


# ------------------------------------------------------------------------------------------------
# Hydra: does the composed config know each key?
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def compose(overrides: tuple[str, ...]):
    """train.py's config (with hydra's) for these overrides; the exception when it does not compose."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import train  # noqa: F401  (registers the ${project_root:} resolver)

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        try:
            return hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        except Exception as e:  # noqa: BLE001  (the message is the finding)
            return e


def override_errors(overrides: list[str], multirun: bool = False) -> list[tuple[str, str]]:
    """(word to find in the doc, message) for each override naming an unknown key or group option,
    or (outside --multirun) a sweep: Hydra stops on `key=a,b` with "Ambiguous value"."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not overrides:
        return []
    parser = OverridesParser.create()
    structural, keys, errors = [], [], []
    for text in overrides:
        key = text.split("=", 1)[0]
        try:
            (o,) = parser.parse_overrides([text])
        except Exception:  # noqa: BLE001
            # A value the grammar refuses (an unexpanded $VAR, a placeholder): only the key is checked.
            try:
                (o,) = parser.parse_overrides([f"{key}=x"])
            except Exception as e:  # noqa: BLE001
                errors.append((key, f"override {text!r} does not parse: {str(e).splitlines()[0]}"))
                continue
            text = f"{key}=x"
        if o.is_sweep_override() and not multirun:
            errors.append((key, f"override {text!r} is a sweep, which Hydra refuses outside --multirun "
                                "(\"Ambiguous value\"): write a list, key=[a,b], or quote the value"))
            continue
        group = (CONFIGS / o.key_or_group.replace(".", "/")).is_dir()
        if group or o.is_add() or o.is_force_add() or o.is_delete():
            structural.append((text, o, group))
        else:
            keys.append(o.key_or_group)
    cfg = compose(tuple(t for t, _, _ in structural))
    if isinstance(cfg, Exception):
        base = [t for t, _, g in structural if g]
        for text, o, group in structural:       # which one: each alone on the groups that compose
            alone = compose(tuple([b for b in base if b != text and not isinstance(compose((b,)), Exception)]
                                  + [text]))
            if isinstance(alone, Exception):
                what = (f"group option {o.key_or_group}={o.value()} unknown" if group
                        else f"override {text}: {str(alone).splitlines()[0]}")
                errors.append((o.key_or_group, what))
        if not errors:
            errors.append((overrides[0], f"config does not compose: {str(cfg).splitlines()[0]}"))
        return errors
    for key in keys:
        if not has_key(cfg, key):
            errors.append((key, f"key {key} unknown"))
    return errors


def has_key(cfg, key: str) -> bool:
    """Whether the dotted key (list indices included) exists, without resolving its value (paths hold
    ${hydra:...} interpolations that only resolve inside a running Hydra app)."""
    from omegaconf import DictConfig, ListConfig

    node = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        try:
            if isinstance(node, DictConfig):
                node = node._get_node(part, throw_on_missing_key=False)
            elif isinstance(node, ListConfig):
                node = node._get_node(int(part))
            else:
                return False
        except Exception:  # noqa: BLE001  (struct mode, a bad index: not there)
            return False
        if node is None:
            return False
        if i < len(parts) - 1 and node._is_interpolation():
            node = node._dereference_node()
    return True


def command_errors(cmd: Command, doc: str) -> list[str]:
    """Everything a command gets wrong, as "DOC:LINE: script ..."."""
    if not cmd.args and (REPO / cmd.script).is_file():
        return []               # a script named in prose: nothing to check
    cli, shown = command_cli(cmd)
    if cli.error:
        if "No module named" in cli.error:      # an optional dependency missing here: not the doc's fault
            return []
        return [f"{doc}:{cmd.lines[0][0]}: {cli.error}"]
    flags, overrides = split_args(cmd, cli)
    out = []
    for f in flags:
        if f not in cli.flags:
            longer = [k for k in cli.flags if k.startswith(f) and f.startswith("--")]
            # argparse would take a unique prefix (--restart for --restarts): a doc writes it in full.
            hint = f" (argparse reads it as {longer[0]}: write that)" if len(longer) == 1 else ""
            out.append(f"{doc}:{cmd.line_of(f)}: {shown} flag {f} unknown{hint}")
    multirun = bool({"--multirun", "-m"} & set(flags))
    out += [f"{doc}:{cmd.line_of(word)}: {shown} {msg}" for word, msg in override_errors(overrides, multirun)]
    return out


def check_doc(text: str, doc: str) -> list[str]:
    return [e for cmd in doc_commands(text) for e in command_errors(cmd, doc)]


# ------------------------------------------------------------------------------------------------
# Runnable blocks
# ------------------------------------------------------------------------------------------------
def compiles_for_a_tpu(block: Block) -> bool:
    """Whether a block runs scripts/compile_tpu.py on an experiment planned for a TPU slice (which
    needs the tpu extra's libtpu; a GPU or sample experiment's plan does not)."""
    text = "\n".join(s for _, s in block.lines)
    return any(compose((f"experiment={name}",)).tpu.topology
               for name in re.findall(r"compile_tpu\.py\b[^\n]*?\bexperiment=(\S+)", text))


def runnable_blocks(text: str) -> list[Block]:
    return [b for b in split_markdown(text)[0] if b.runnable]


def run_block(block: Block, tmp: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a runnable block: python in tmp with the repo on PYTHONPATH; bash in a copy of the repo
    with HOME in tmp."""
    code = textwrap.dedent("\n".join(t for _, t in block.lines)) + "\n"
    home = tmp / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HOME=str(home))
    if block.lang in PYTHON_LANGS:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        (tmp / "snippet.py").write_text(code)
        cmd, cwd = [sys.executable, "snippet.py"], tmp
    elif block.lang in SHELL_LANGS - {"console"}:
        cwd = tmp / "repo"
        if not cwd.exists():
            shutil.copytree(REPO, cwd, ignore=COPY_IGNORE, symlinks=True)
        env["PYTHONPATH"] = os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])
        (tmp / "snippet.sh").write_text(code)
        cmd = ["bash", "-eo", "pipefail", str(tmp / "snippet.sh")]
    else:
        raise ValueError(f"line {block.line}: a runnable block must be python or bash, not {block.lang!r}")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# The experiments table
# ------------------------------------------------------------------------------------------------
SUFFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> tuple[float, float]:
    """ "4.2B" -> (4.2e9, 0.05e9): the value and half a unit of its last printed digit."""
    m = re.search(r"([0-9][0-9,]*)(?:\.([0-9]+))?\s*([kKMBGT]?)(?![A-Za-z])", text.replace("*", ""))
    if not m:
        raise ValueError(f"no token count in {text!r}")
    whole, frac, suffix = m.group(1).replace(",", ""), m.group(2) or "", m.group(3)
    scale = SUFFIX[suffix]
    return float(f"{whole}.{frac or 0}") * scale, 0.5 * 10 ** -len(frac) * scale


def budget(name: str) -> tuple[int, int, int]:
    cfg = compose((f"experiment={name}",))
    if isinstance(cfg, Exception):
        raise cfg
    return int(cfg.train.steps), int(cfg.data.global_batch_size), int(cfg.data.seq_len)


def experiments_table_errors(text: str, doc: str, experiments: list[str]) -> list[str]:
    found = [t for t in tables(text) if t[1] and t[1][0].strip("` *").lower() == "experiment"]
    if not found:
        return [f"{doc}: no experiments table (a markdown table whose header row starts with `| experiment |`, "
                "one row per configs/experiment/*.yaml, first column `name`, a `tokens` column)"]
    line, header, rows = found[0]
    col = next((i for i, h in enumerate(header) if h.strip("* ").lower().startswith("tokens")), None)
    errors = [] if col is not None else [f"{doc}:{line}: the experiments table has no `tokens` column"]
    named = {}
    for n, row in rows:
        m = re.search(r"`([\w.-]+)`", row[0])
        if not m:
            errors.append(f"{doc}:{n}: the experiments table's row does not name an experiment as `name`")
            continue
        named[m.group(1)] = (n, row)
    for name in sorted(set(experiments) - set(named)):
        errors.append(f"{doc}:{line}: the experiments table lacks `{name}` (configs/experiment/{name}.yaml)")
    for name in sorted(set(named) - set(experiments)):
        errors.append(f"{doc}:{named[name][0]}: the experiments table names `{name}`, "
                      f"which has no configs/experiment/{name}.yaml")
    if col is None:
        return errors
    for name in sorted(set(named) & set(experiments)):
        n, row = named[name]
        steps, batch, seq = budget(name)
        tokens = steps * batch * seq
        try:
            value, tol = parse_count(row[col] if col < len(row) else "")
        except ValueError as e:
            errors.append(f"{doc}:{n}: `{name}`: {e}")
            continue
        if abs(value - tokens) > tol * (1 + 1e-9):
            errors.append(f"{doc}:{n}: `{name}`: tokens {row[col]!r}, but train.steps x data.global_batch_size x "
                          f"data.seq_len = {steps} x {batch} x {seq} = {tokens:,}")
    return errors


def experiment_names() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


# ================================================================================================
# Tests: the real docs
# ================================================================================================
DOCS = doc_files()


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_doc_commands_know_their_flags_and_keys(doc):
    errors = check_doc(doc.read_text(), rel(doc))
    assert not errors, "stale commands:\n" + "\n".join(errors)


def _runnable_params():
    params = [pytest.param(doc, b, id=f"{rel(doc)}:{b.line}") for doc in DOCS for b in runnable_blocks(doc.read_text())]
    return params or [pytest.param(None, None, id="no-runnable-blocks-yet")]


SYNTHETIC_RUNNABLE = f"""\
Some prose.

{RUNNABLE}
```python
import train, sys
print("ran", train.PROJECT_ROOT.name, file=sys.stderr)
```

```bash
exit 3   # not marked: never run
```
"""


@pytest.mark.slow
@pytest.mark.parametrize("doc, block", _runnable_params())
def test_runnable_blocks_exit_0(doc, block, tmp_path):
    if block is None:           # no doc marks a block yet: the collector and the runner on a synthetic one
        blocks = runnable_blocks(SYNTHETIC_RUNNABLE)
        assert [(b.lang, b.line) for b in blocks] == [("python", 4)]
        doc, block = Path("SYNTHETIC.md"), blocks[0]
    needs = {m for m in re.findall(r"^\s*(?:from|import) (\w+)", "\n".join(s for _, s in block.lines), re.M)
             if m in OPTIONAL_IMPORTS}
    for module in sorted(needs):    # a snippet of an optional extra's page runs where the extra is installed
        pytest.importorskip(module, reason=f"{rel(doc)}:{block.line} needs the {OPTIONAL_IMPORTS[module]} extra")
    if compiles_for_a_tpu(block):   # a TPU experiment's plan: its slice's devices come from libtpu
        pytest.importorskip("libtpu", reason=f"{rel(doc)}:{block.line} needs the tpu extra")
    r = run_block(block, tmp_path)
    assert r.returncode == 0, f"{rel(doc)}:{block.line}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


# Markdown links: [text](target) and [text](target#anchor), not inside code.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page: each heading's slug (lowercase; punctuation but - and _
    dropped; spaces to -; repeats numbered -1, -2, ...) and every explicit <a id="...">."""
    anchors: set[str] = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    blocks, _ = split_markdown(text)
    in_code = {n for b in blocks for n, _ in b.lines} | {b.line for b in blocks}
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m or n in in_code:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        anchors.add(slug if k == 0 else f"{slug}-{k}")
    return anchors


def link_errors(doc: Path, text: str) -> list[str]:
    """Relative links that name a missing file, or an anchor the target page does not have."""
    errors = []
    blocks, _ = split_markdown(text)
    in_code = {n for b in blocks for n, _ in b.lines}
    for n, line in enumerate(text.splitlines(), 1):
        if n in in_code:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                errors.append(f"{rel(doc)}:{n}: link to {path}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
                errors.append(f"{rel(doc)}:{n}: link to {target}: {rel(dest)} has no heading #{anchor}")
    return errors


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_doc_links_reach_their_pages_and_headings(doc):
    errors = link_errors(doc, doc.read_text())
    assert not errors, "\n".join(errors)


def test_link_checker_reports_a_missing_page_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Some `code`: here\n")
    doc = tmp_path / "b.md"
    text = ("[ok](a.md) [ok](a.md#some-code-here) [x](nope.md)\n[y](a.md#nowhere) [web](https://x.org/a#b)\n"
            "```\n[in code](nope.md)\n```\n")
    assert [e.split(": ", 1)[1] for e in link_errors(doc, text)] == [
        "link to nope.md: no such file", f"link to a.md#nowhere: {tmp_path / 'a.md'} has no heading #nowhere"]


def test_readme_install_table_names_every_extra():
    """README's install table (header `| extra |`) lists each extra of pyproject.toml, no more, no less."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| extra |"))
    named = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        named |= set(re.findall(r"`([\w-]+)`", line.split("|")[1]))
    assert named == extras, f"README's install table: missing {sorted(extras - named)}, " \
                            f"unknown {sorted(named - extras)}"


def test_readme_experiments_table():
    errors = experiments_table_errors((REPO / "README.md").read_text(), "README.md", experiment_names())
    assert not errors, "\n".join(errors)


# ================================================================================================
# Tests: the parsers on synthetic markdown (a mistake in a doc is caught)
# ================================================================================================
def test_unknown_train_key_is_reported_with_its_line():
    doc = "# T\n\n```bash\npython train.py model=1b train.steps=10\npython train.py model.nope=1\n```\n"
    assert check_doc(doc, "T.md") == ["T.md:5: train.py key model.nope unknown"]


def test_a_sweep_outside_multirun_is_reported():
    # data.dedup=exact,fuzzy stopped train.py with Hydra's "Ambiguous value" (docs/data.md had it)
    doc = ("# T\n\n```bash\npython train.py data.dedup=exact,fuzzy\npython train.py 'data.dedup=[exact,fuzzy]'\n"
           "python train.py --multirun optimizer.lr=1e-3,3e-4\n```\n")
    assert [e.split(" is a sweep")[0] for e in check_doc(doc, "T.md")] == [
        "T.md:4: train.py override 'data.dedup=exact,fuzzy'"]


def test_continuations_comments_inline_and_nested_commands():
    doc = textwrap.dedent("""\
        Run `python train.py data.nope=1` first, then `train.steps` (a key, not a command).

        ```bash
        python train.py experiment=v4_32_llama_1b \\
            train.steps=10 \\
            train.nope=3      # model.commented_out=1 is a comment
        JAX_PLATFORMS=cpu python train.py +extra.thing=1 extra.thing=2 hydra.run.dir=/tmp/x 'name=a b'
        gcloud compute tpus tpu-vm ssh x --command 'cd ~/jaxpt && python train.py optimizer.nope=1'
        python train.py experiment=nope
        python train.py eval=sample 'eval.tasks=[{name: h, path: /d/YOUR_FILE.jsonl, format: h}]' \\
            data.paths='/mnt/*/x.gz' checkpoint.dir=gs://YOUR_BUCKET/run distributed.process_id=$RANK
        ```
        """)
    assert check_doc(doc, "D.md") == [
        "D.md:6: train.py key train.nope unknown",
        "D.md:8: train.py key optimizer.nope unknown",
        "D.md:9: train.py group option experiment=nope unknown",
        "D.md:1: train.py key data.nope unknown",
    ]


def test_script_flags_subcommands_and_overrides_after_dashes():
    doc = textwrap.dedent("""\
        ```bash
        python scripts/tpu.py setup --name p --extras tpu,gcs --mount-bucket b
        python scripts/tpu.py run --name p --restarts 3 --env-from-local K -- experiment=v4_32_llama_1b model.nope=1
        python scripts/tpu.py setup --jax-extra tpu
        python scripts/tpu.py --dry-run logs -n 5 --follow --nope
        python scripts/compile_tpu.py experiment=v4_32_llama_1b --topology v6e-16 --quick model.remat=full mesh.nope=2
        python scripts/launch_local.py -p 2 -d 1 -- train.steps=2
        ssh w 'python scripts/prepare_data.py --paths x --process-index $(curl -s -H M:1 u)' && ls scripts/bench/*.py
        python scripts/nope.py --x
        python scripts/tpu.py run --restart 2 -- name=x
        ```
        Or `tpu.py run ... -- data.nope=1`.
        """)
    assert check_doc(doc, "S.md") == [
        "S.md:3: scripts/tpu.py run key model.nope unknown",
        "S.md:4: scripts/tpu.py setup flag --jax-extra unknown",
        "S.md:5: scripts/tpu.py logs flag --nope unknown",
        "S.md:6: scripts/compile_tpu.py key mesh.nope unknown",
        "S.md:9: scripts/nope.py does not exist",
        "S.md:10: scripts/tpu.py run flag --restart unknown (argparse reads it as --restarts: write that)",
        "S.md:12: scripts/tpu.py run key data.nope unknown",
    ]


def test_parse_help_reads_argparse_options():
    cli = script_cli("scripts/tpu.py", "logs")
    assert cli.flags["--lines"] == cli.flags["-n"] == "1" and cli.flags["--follow"] == "0"
    assert "--name" in cli.flags and not cli.hydra
    assert script_cli("scripts/tpu.py").subcommands == ["create", "setup", "sync", "run", "logs", "stop", "delete"]
    assert script_cli("scripts/tpu.py", "run").hydra and script_cli("scripts/compile_tpu.py").hydra
    assert "--multirun" in script_cli("train.py").flags


def test_runnable_marker_collector():
    blocks = runnable_blocks(SYNTHETIC_RUNNABLE)
    assert [(b.lang, b.line, b.lines[0][1]) for b in blocks] == [("python", 4, "import train, sys")]
    # The marker must be the line before the fence (blank lines allowed), not any earlier line.
    assert runnable_blocks(f"{RUNNABLE}\ntext\n```bash\ntrue\n```\n") == []
    assert len(runnable_blocks(f"{RUNNABLE}\n\n```bash\ntrue\n```\n")) == 1


def test_a_tpu_experiments_plan_is_told_from_a_gpu_one():
    """A runnable block compiling a TPU experiment's plan skips without libtpu; a GPU one runs."""
    def block(command):
        return Block("bash", 1, [(2, command)], True)
    assert compiles_for_a_tpu(block("python scripts/compile_tpu.py experiment=v4_32_llama_1b --no-compile"))
    assert not compiles_for_a_tpu(block("python scripts/compile_tpu.py experiment=gpu_8_llama_1b --no-compile"))
    assert not compiles_for_a_tpu(block("python train.py experiment=v4_32_llama_1b"))


def test_run_block_reports_failure(tmp_path):
    script = 'test -f train.py && test "$HOME" != ~root\nfalse\necho no'
    (block,) = runnable_blocks(f"{RUNNABLE}\n```bash\n{script}\n```\n")
    r = run_block(block, tmp_path)
    assert r.returncode == 1 and "no" not in r.stdout           # set -e: the first failure ends it
    assert (tmp_path / "repo" / "train.py").exists() and not (tmp_path / "repo" / ".git").exists()


def test_parse_count():
    assert parse_count("4.2B") == pytest.approx((4.2e9, 0.05e9))
    assert parse_count("**205M**") == pytest.approx((205e6, 0.5e6))
    assert parse_count("1.0T") == pytest.approx((1.0e12, 0.05e12))
    assert parse_count("~157,286,400") == pytest.approx((157286400, 0.5))
    with pytest.raises(ValueError):
        parse_count("n/a")


def test_experiments_table_is_checked_both_ways_and_by_tokens():
    names = ["v4_32_llama_1b", "sample_125m"]
    steps, batch, seq = budget("v4_32_llama_1b")
    tokens = steps * batch * seq
    s_steps, s_batch, s_seq = budget("sample_125m")
    good = textwrap.dedent(f"""\
        | experiment | hardware | tokens |
        |---|---|---|
        | `v4_32_llama_1b` | v4-32 | {tokens / 1e6:.0f}M |
        | `sample_125m` | CPU | {s_steps * s_batch * s_seq / 1e6:.1f}M |
        """)
    assert experiments_table_errors(good, "T.md", names) == []
    bad = good.replace(f"{tokens / 1e6:.0f}M", f"{tokens / 1e6 + 2:.0f}M").replace("`sample_125m`", "`gone`")
    errors = experiments_table_errors(bad, "T.md", names)
    assert errors[0] == "T.md:1: the experiments table lacks `sample_125m` (configs/experiment/sample_125m.yaml)"
    assert errors[1] == "T.md:4: the experiments table names `gone`, which has no configs/experiment/gone.yaml"
    assert errors[2].startswith("T.md:3: `v4_32_llama_1b`: tokens") and len(errors) == 3
    assert experiments_table_errors("| model | x |\n|---|---|\n| a | b |\n", "T.md", names)[0].startswith(
        "T.md: no experiments table")

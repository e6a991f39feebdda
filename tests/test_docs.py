"""The documents resolve: every relative link in README.md, config/README.md and docs/*.md points at a
file that exists (and its #anchor at a heading there, by GitHub's slug rules), and every command
they quote (```bash blocks, and inline code that starts with a program) names a program that
exists, files that exist, and Snakemake rules and targets that the workflow has."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "config" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Programs the documents tell a user to run that neither this repository nor its pip install
# provides: the cluster's SLURM client, a browser opener and a HTTP client. Their presence is the
# user's machine's business; their arguments are still checked.
SYSTEM_PROGRAMS = {"curl", "xdg-open", "srun", "sbatch", "squeue", "scancel", "scontrol"}
# Programs that start a command in inline code (prose such as `--forcerun train` is not a command).
INLINE_PROGRAMS = {
    "bash",
    "pip",
    "python",
    "snakemake",
    "distlm-launch",
    "tensorboard",
    "lm_eval",
    "torchrun",
    "mpiexec",
    *SYSTEM_PROGRAMS,
}
# Top-level folders whose paths name files that must exist (results/ and logs/ are outputs).
REPO_DIRS = {"benchmarks", "config", "docs", "profiles", "src", "tests", "workflow", ".ci"}
# Options whose value is a file the command writes.
OUTPUT_OPTIONS = {"--out", "--output", "-o"}
# Snakemake options that take values (nargs=+ for the ones listed in MANY).
SNAKEMAKE_VALUED = {"--profile", "--directory", "-s", "--snakefile", "--cores", "-c"}
SNAKEMAKE_MANY = {"--configfile", "--configfiles", "--config", "-C", "--forcerun", "-R"}


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    argv: tuple[str, ...]
    block: tuple[tuple[str, ...], ...]  # the commands before it in the same block

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {shlex.join(self.argv)}"


def _without_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(doc: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _without_fences(doc.read_text(encoding="utf-8")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(doc: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative Markdown link outside code."""
    out = []
    for n, line in _without_fences(doc.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                out.append((n, target))
    return out


def link_error(doc: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    if not dest.exists():
        return f"{path} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{dest.relative_to(ROOT)} has no heading #{anchor}"
    return None


def _split(line: str) -> list[tuple[str, ...]]:
    """The simple commands of one shell line: comments dropped, split at && || | ;."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|"):
            out.append(tuple(cur))
            cur = []
        else:
            cur.append(tok)
    out.append(tuple(cur))
    return [c for c in out if c]


def commands(doc: Path) -> list[Command]:
    text = doc.read_text(encoding="utf-8")
    out: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```"):
            lang, i = fence[3:].strip(), i + 1
            block: list[tuple[str, ...]] = []
            while not lines[i].strip().startswith("```"):
                start, line = i + 1, lines[i]
                while line.rstrip().endswith("\\"):  # a continued line
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                if lang == "bash":
                    for argv in _split(line):
                        out.append(Command(doc, start, argv, tuple(block)))
                        block.append(argv)
                i += 1
        i += 1
    for n, line in _without_fences(text):
        for code in re.findall(r"`([^`]+)`", line):
            words = code.split()
            if len(words) > 1 and words[0] in INLINE_PROGRAMS:
                for argv in _split(code):  # "..." stands for arguments left out
                    out.append(Command(doc, n, tuple(w for w in argv if w != "..."), ()))
    return out


def _program(argv: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """The program and its arguments, past VAR=value prefixes ("" for `export` and assignments)."""
    while argv and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]
    if not argv or argv[0] == "export":
        return "", ()
    return argv[0], argv[1:]


def _made_before(path: str, cmd: Command) -> bool:
    """A path that an earlier command of the same block names (it writes it, e.g. a profile)."""
    return any(path in argv for argv in cmd.block)


@cache
def rules() -> frozenset[str]:
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--list-rules", "-s", str(ROOT / "Snakefile")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return frozenset(out.split())


def command_errors(cmd: Command) -> list[str]:
    prog, args = _program(cmd.argv)
    if prog == "eval":  # eval "$(python x.py env)": the inner command
        inner = re.fullmatch(r"\$\((.*)\)", args[0] if args else "")
        return (
            command_errors(
                Command(cmd.doc, cmd.line, tuple(shlex.split(inner.group(1))), cmd.block)
            )
            if inner
            else ["eval of something other than $(...)"]
        )
    errors = []
    if not prog:  # a variable set for the commands after it
        return []
    if prog not in SYSTEM_PROGRAMS and shutil.which(prog) is None:
        errors.append(f"{prog} is not on PATH")
    outputs = {args[i + 1] for i, a in enumerate(args[:-1]) if a in OUTPUT_OPTIONS}
    for a in args:
        if a in outputs or a.partition("=")[0] in OUTPUT_OPTIONS:
            continue  # a file the command writes
        value = a.partition("=")[2] if a.startswith("--") and "=" in a else a
        top = value.split("/", 1)[0]
        missing = "/" in value and top in REPO_DIRS and not (ROOT / value).exists()
        if missing and not _made_before(value, cmd):
            errors.append(f"{value} does not exist")
    if prog == "python" and args:
        if args[0] == "-m":
            if importlib.util.find_spec(args[1]) is None:
                errors.append(f"module {args[1]} is not importable")
        elif not args[0].startswith("-") and not (ROOT / args[0]).is_file():
            errors.append(f"{args[0]} is not a file")
    if prog == "bash" and args and not (ROOT / args[0]).is_file():
        errors.append(f"{args[0]} is not a file")
    if prog == "pip":
        errors += _pip_errors(args)
    if prog == "snakemake":
        errors += _snakemake_errors(args, cmd)
    return errors


def _pip_errors(args: tuple[str, ...]) -> list[str]:
    """`-e ".[x]"` and `distlm[x]` name extras that pyproject.toml declares."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = set(meta.get("optional-dependencies", {}))
    errors = []
    for a in args:
        m = re.fullmatch(rf"(\.|{meta['name']})(?:\[([\w,-]+)\])?", a)
        if m and m.group(2):
            errors += [
                f"pyproject.toml has no extra {e!r}"
                for e in m.group(2).split(",")
                if e not in extras
            ]
    return errors


@dataclass
class SnakemakeArgs:
    paths: list[tuple[str, str]]  # (option, path) of --profile, --directory, -s
    configfiles: list[str]
    forced: list[str]
    targets: list[str]


def snakemake_args(args: tuple[str, ...]) -> SnakemakeArgs:
    parsed = SnakemakeArgs([], [], [], [])
    it = iter(args)
    many = None  # the nargs=+ option whose values follow
    for a in it:
        if a.startswith("-"):
            opt, many = a.split("=", 1)[0], None
            if opt == "--report":  # an optional value: the report's file
                many = opt
            elif opt in SNAKEMAKE_VALUED and "=" not in a:
                value = next(it)
                if opt in {"--profile", "--directory", "-s", "--snakefile"}:
                    parsed.paths.append((opt, value))
            elif opt in SNAKEMAKE_MANY:
                many = opt
        elif many in {"--configfile", "--configfiles"}:
            parsed.configfiles.append(a)
        elif many in {"--forcerun", "-R"}:
            parsed.forced.append(a)
        elif many == "--report" and re.search(r"\.(html|zip)$", a):
            many = None
        elif many is None:
            parsed.targets.append(a)
    return parsed


def _snakemake_errors(args: tuple[str, ...], cmd: Command) -> list[str]:
    """Paths and config files exist, forced rules and rule targets are rules. File targets are
    planned by one dry run (test_every_quoted_command_resolves)."""
    parsed = snakemake_args(args)
    errors = [
        f"{opt} {value}: does not exist"
        for opt, value in parsed.paths
        if not ((ROOT / value).exists() or _made_before(value, cmd))
    ]
    errors += [
        f"--configfile {c}: no such file" for c in parsed.configfiles if not (ROOT / c).is_file()
    ]
    # --configfile takes every value up to the next option: a target there is read as a config
    # file (tests/test_gpu.py's helper once put its targets so); targets go first
    errors += [
        f"--configfile {c}: not a config file (a target after --configfile is read as one; put "
        "targets first)"
        for c in parsed.configfiles
        if not c.endswith((".yaml", ".yml", ".json"))
    ]
    errors += [f"--forcerun {r}: no such rule" for r in parsed.forced if r not in rules()]
    errors += [
        f"target {t}: no such rule" for t in parsed.targets if "/" not in t and t not in rules()
    ]
    return errors


CASES = [c for doc in DOCS for c in commands(doc)]


def test_the_documents_quote_commands():
    """The parser finds the commands (a test over nothing would pass on any document)."""
    quoted = {shlex.join(c.argv) for c in CASES}
    assert "bash tests/run.sh" in quoted
    assert "snakemake --profile profiles/local" in quoted
    assert any(c.doc.parent.name == "docs" for c in CASES)


def test_every_relative_link_resolves():
    broken = [
        f"{doc.relative_to(ROOT)}:{n}: {target}: {err}"
        for doc in DOCS
        for n, target in links(doc)
        if (err := link_error(doc, target))
    ]
    assert sum(len(links(doc)) for doc in DOCS) > 20
    assert not broken, "\n".join(broken)


def test_every_quoted_command_resolves(tmp_path):
    broken = [f"{c}: {e}" for c in CASES for e in command_errors(c)]
    assert not broken, "\n".join(broken)
    # The targets of the default config's commands (rules and files): one dry run plans them all.
    targets = {
        t
        for c in CASES
        if _program(c.argv)[0] == "snakemake"
        for parsed in [snakemake_args(_program(c.argv)[1])]
        if not parsed.configfiles
        for t in parsed.targets
    }
    assert "results/train/final" in targets
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "-q",
            "--cores",
            "1",
            "-s",
            str(ROOT / "Snakefile"),
        ]
        + ["--directory", str(tmp_path), *sorted(targets)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (
        f"snakemake -n {' '.join(sorted(targets))}:\n{done.stdout}{done.stderr}"
    )


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("snakemake --profile profiles/local --forcerun serialise_model", "no such rule"),
        ("snakemake --profile profiles/lokal", "does not exist"),
        ("snakemake --profile profiles/local --configfile config/nope.yaml", "no such file"),
        (
            "snakemake --profile profiles/local --configfile config/gpu.yaml results/train/final",
            "not a config file (a target after --configfile",
        ),
        ("python benchmarks/train/bench.py --repeats 2", "is not a file"),
        ("python -m distlm.nope --write", "not importable"),
        ("bash tests/runs.sh", "is not a file"),
        ("pip install torch -e '.[tests]'", "no extra 'tests'"),
        ("distlm-lunch srun-torchrun workflow/scripts/train.py", "not on PATH"),
        ("srun -n 3 python workflow/scripts/inferr.py", "does not exist"),
    ],
)
def test_a_broken_command_is_found(line, error):
    """The checks fail on the mistakes they are for (a misspelt rule, file, module, extra, program)."""
    [argv] = _split(line)
    errors = command_errors(Command(ROOT / "README.md", 1, argv, ()))
    assert any(error in e for e in errors), errors


def test_a_broken_link_is_found():
    readme = ROOT / "README.md"
    assert link_error(readme, "docs/slurm.md#the-profile") is None
    assert "no heading #the-profiles" in (link_error(readme, "docs/slurm.md#the-profiles") or "")
    assert "does not exist" in (link_error(readme, "docs/slurms.md") or "")
    assert slug("Serving (`serve`)") == "serving-serve"
    assert slug("Set-up: two commands") == "set-up-two-commands"


def _summary(*args: str) -> subprocess.CompletedProcess[str]:
    """The README's performance table renderer, as a user runs it."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "summary.py"), *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)


def test_the_readme_performance_table_is_what_the_committed_json_says():
    done = _summary("--check")
    assert done.returncode == 0, done.stdout + done.stderr
    block = (ROOT / "README.md").read_text().split("benchmarks/summary.py")[1]
    # one row a goal: the figures are in it (a renderer writing an empty table would pass --check)
    for figure in ("transformers serve --continuous-batching", "HF `Trainer`", "CTranslate2"):
        assert figure in block


def test_a_stale_or_missing_performance_table_is_found(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- performance:")
    row = text.index("| serving, 1 stage, 1 client: throughput", start)
    figure = text.index("x |", row + 40)  # the first figure of the row
    readme.write_text(text[: figure - 4] + "9.99" + text[figure:])
    done = _summary("--check", "--readme", str(readme))
    assert done.returncode == 1
    assert f"{readme}: the performance table differs from the committed JSON" in done.stderr
    # without --check it renders the figure from the JSON again, and then the check passes
    assert _summary("--readme", str(readme)).returncode == 0
    assert readme.read_text() == text
    readme.write_text(text[:start])
    done = _summary("--check", "--readme", str(readme))
    assert done.returncode != 0 and f"{readme} has no performance block" in done.stderr

"""The package's layout (docs/architecture.md, "The stages"): one meaning per file name, and each
workflow stage's rule, commands and home as its row of `distlm.dag.stages.STAGES` names them.

Two files of `src/distlm` may share a name only where the name plays one role in both: the
roles below, each said once. A new file whose name another file already bears with another
meaning fails here, naming both.
"""

from __future__ import annotations

import importlib
import re
from collections import defaultdict
from pathlib import Path

from distlm.dag.stages import STAGES
from distlm.settings import Settings

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "distlm"

# A name that several packages use for one role: the role, said once.
SHARED_ROLES = {
    "blocks.py": "a model family's blocks' math (family/<name>/blocks.py)",
    "model.py": "a model family's model and tensor names (family/<name>/model.py)",
    "stage.py": "a workflow stage's function, in the stage's package (data/, model/, broadcast/, evaluate/)",
    "errors.py": "the package's error types",
    "messages.py": "the package's typed, versioned wire messages",
    "metrics.py": "the package's metrics (its rows or its Prometheus series)",
    "state.py": "what the package's long-lived object holds (the trainer's, the API server's)",
    "documents.py": "the versioned documents of a stage's home, or their base (core/)",
}


def _named_by_role(path: Path) -> str | None:
    """The role a path has by where it stands, or None.

    - settings/<section>.py types the config's section <section> (a field of `Settings`);
    - entry/<name>.py is the command of the stage whose home is distlm/<name>(.py|/): it is
      named after that home (entry/infer.py and entry/serve.py start the pipeline's stages).
    """
    rel = path.relative_to(PACKAGE)
    if rel.parent == Path("settings") and rel.stem in Settings.model_fields:
        return "settings/<section>.py: the config section <section>"
    if rel.parent == Path("entry"):
        return "entry/<name>.py: a stage's command"
    return None


def test_a_file_name_means_one_thing_in_the_package():
    by_name: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            by_name[path.name].append(path)
    clashes = []
    for name, paths in by_name.items():
        if len(paths) < 2:
            continue
        # the files the name is left to once those named by their place are set aside
        rest = [p for p in paths if _named_by_role(p) is None]
        if len(rest) > 1 and name not in SHARED_ROLES:
            clashes.append(f"{name}: " + ", ".join(str(p.relative_to(PACKAGE)) for p in rest))
    assert not clashes, (
        "file names with more than one meaning (rename one, or add the name's one role to "
        "SHARED_ROLES):\n  " + "\n  ".join(clashes)
    )


def test_shared_roles_are_still_shared():
    """A role kept after its name stopped being shared is a stale line: remove it."""
    counts: dict[str, int] = defaultdict(int)
    for path in PACKAGE.rglob("*.py"):
        counts[path.name] += 1
    assert [n for n in SHARED_ROLES if counts[n] < 2] == []


# ----------------------------------------------------------------------------- stage homes

ROOT = PACKAGE.parents[1]
RULES = ROOT / "workflow" / "rules"
# rules that run a command but are no stage of the DAG: resolve_config writes the stage configs
NOT_STAGES = {"resolve_config"}


def _rule_commands() -> dict[str, set[str]]:
    """Each rule's commands as its .smk text names them (a rule may be in two files: report)."""
    found: dict[str, set[str]] = defaultdict(set)
    block = re.compile(r"^(?:rule|checkpoint) (\w+):\n(.*?)(?=^\S|\Z)", re.MULTILINE | re.DOTALL)
    for smk in sorted(RULES.glob("*.smk")):
        for rule, body in block.findall(smk.read_text(encoding="utf-8")):
            found[rule].update(
                {f"distlm.entry.{m}" for m in re.findall(r'torchrun_shell\(\s*"(\w+)"', body)}
                | set(re.findall(r"python -m (distlm\.entry\.\w+)", body))
                | {f"workflow/scripts/{s}" for s in re.findall(r'"\.\./scripts/(\w+\.py)"', body)}
            )
    return {rule: commands for rule, commands in found.items() if commands}


def test_each_rule_runs_the_commands_its_stage_declares():
    declared = {s.rule: s.commands for s in STAGES.values()}
    declared |= {rule: cmds for s in STAGES.values() for rule, cmds in s.parts.items()}
    commands = _rule_commands()
    assert set(commands) - NOT_STAGES == set(declared), "a rule with a command is a stage's"
    for rule, named in commands.items():
        if rule in declared:
            assert named == set(declared[rule]), rule


def _source(command: str) -> Path:
    if command.startswith("distlm."):
        return PACKAGE.parent / (command.replace(".", "/") + ".py")
    return ROOT / command


def test_each_command_calls_into_its_stages_home():
    """A command only reads its inputs and calls the stage's logic, which lives in its home."""
    for stage in STAGES.values():
        home = importlib.import_module(stage.home)  # the home exists
        assert home.__name__ == stage.home
        for command in (*stage.commands, *(c for cs in stage.parts.values() for c in cs)):
            text = _source(command).read_text(encoding="utf-8")
            assert re.search(rf"^\s*(from|import) {re.escape(stage.home)}\b", text, re.MULTILINE), (
                f"{command} (stage {stage.name}) imports nothing of its home {stage.home}"
            )

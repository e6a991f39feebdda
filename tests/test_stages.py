"""Stage contracts (distlm.dag.stages) and the library's layering: declared keys exist, each stage gets
exactly its keys, output names are declared once, documents refuse other versions, and no module
imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, TINY

from distlm.core.documents import DocumentError, read_document, write_document
from distlm.core.section import ONLY_WHEN_SET
from distlm.dag.config import load_config
from distlm.dag.stages import JOBS, REPORT_READS, STAGES, schema_keys, select, stage_config
from distlm.data.documents import DataStats
from distlm.evaluate.documents import EvalReport
from distlm.settings.root import Settings

SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
SRC = ROOT / "src" / "distlm"


def _only_when_set(key: str) -> bool:
    """Whether the settings field of dotted `key` is ONLY_WHEN_SET (distlm.core.section)."""
    *parents, leaf = key.split(".")
    model: Any = Settings
    for p in parents:
        model = model.model_fields[p].annotation
    return model.model_fields[leaf].json_schema_extra is ONLY_WHEN_SET["json_schema_extra"]


def test_declared_keys_exist_and_every_key_has_a_reader():
    cfg = load_config(TINY)
    keys = schema_keys(SCHEMA)
    for stage in STAGES.values():
        for key in stage.keys:
            assert any(k == key or k.startswith(key + ".") for k in keys), (stage.name, key)
        # every declared key resolves in a validated config, but for a key newer than the
        # configs (ONLY_WHEN_SET), which the config holds only when it is not at its default
        select(cfg, [k for k in stage.keys if not _only_when_set(k)])
    unread = [k for k in keys if not any(s.covers(k) for s in STAGES.values())]
    assert not unread, f"schema keys no stage reads: {unread}"


def test_a_stage_gets_exactly_its_keys():
    cfg = load_config(TINY)
    train = stage_config(cfg, "train")
    assert set(train) == {"runtime", "train", "transfer"}
    assert set(train["transfer"]) == {"transport", "bucket_mb", "chunk_mb", "timeout_s"}
    assert stage_config(cfg, "shard") == {"inference": {"stages": 3}}
    assert "serve" not in stage_config(cfg, "inference").get("inference", {})
    with pytest.raises(KeyError, match="does not exist"):
        select(cfg, ["train.no_such_key"])


def test_jobs_name_declared_stages_and_consumers():
    for job, (stage, consumes) in JOBS.items():
        assert stage in STAGES and all(c in JOBS for c in consumes), job


def test_every_job_feeds_the_report_which_runs_last():
    """The report depends on every other job of `rule all`, directly or through what it consumes
    (docs/stages.md, "Reports": it runs once, last, and again when any of them changes), and the
    jobs are declared upstream first (each after what it consumes: no cycle, and the rerun table
    lists them in the order they run)."""
    order = list(JOBS)
    for job, (_, consumes) in JOBS.items():
        assert all(order.index(c) < order.index(job) for c in consumes), job
    upstream, todo = set(), ["report"]
    while todo:
        for c in JOBS[todo.pop()][1]:
            if c not in upstream:
                upstream.add(c)
                todo.append(c)
    assert upstream == set(JOBS) - {"report"}
    assert order[-1] == "report"
    # derived from Stage.consumes: each evaluate instance reads the job writing its model folder
    assert JOBS["evaluate[base]"] == ("eval", ("prepare_data", "serialize_model"))
    assert JOBS["evaluate[trained]"] == ("eval", ("prepare_data", "train"))
    assert JOBS["shard[trained]"] == ("shard", ("train",))
    assert "serve" not in JOBS and "serve_shard" not in JOBS  # started by name, not in rule all
    # the report consumes exactly the jobs it reads a file of
    assert set(JOBS["report"][1]) == {job for job, _ in REPORT_READS.values()}


def test_the_workflow_reads_no_config_value_by_string():
    """Rules read the typed settings (S, RUNS.settings_of), never `config[...]`, and no rule file
    branches on a sweep: a config without one is the one-variant layout (distlm.dag.sweep.Single)."""
    files = [ROOT / "Snakefile", *sorted((ROOT / "workflow/rules").glob("*.smk"))]
    files += sorted((ROOT / "workflow/scripts").glob("*.py"))
    for f in files:
        text = f.read_text()
        for bad in ('config["', "config['", "setting(", "if SWEEP", "SWEEP.", "entry_point("):
            assert bad not in text, (f.name, bad)


def _string_literals(path: Path) -> set[str]:
    """String constants of a Python file, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


def test_output_file_names_are_written_once():
    """No declared output name appears as a literal in the rules, scripts or library."""
    names = {
        out.name
        for s in STAGES.values()
        for out in s.outputs.values()
        if "{" not in out.name and "." in out.name
    }
    for path in [*(ROOT / "workflow/rules").glob("*.smk"), ROOT / "Snakefile"]:
        text = path.read_text()
        assert not [n for n in names if n in text], path
    code = [p for p in SRC.rglob("*.py") if p.name != "stages.py"]
    for path in [*code, *(ROOT / "workflow/scripts").glob("*.py")]:
        found = [
            lit
            for lit in _string_literals(path)
            for n in names
            if lit == n or lit.endswith("/" + n)
        ]
        assert not found, (path, found)


def test_declared_documents_are_document_types():
    """Each stage's report document is a type of its home's documents (distlm.<home>.documents:
    it lives with the stage that writes it)."""
    import importlib

    from distlm.core.documents import Document

    for stage in STAGES.values():
        if stage.document is not None:
            output, kind = stage.document
            docs = importlib.import_module(f"{stage.home}.documents")
            assert output in stage.outputs and issubclass(getattr(docs, kind), Document)


def test_documents_refuse_other_kinds_versions_and_fields(tmp_path):
    doc = EvalReport(
        name="base",
        method="m",
        model={},
        data={},
        context=8,
        stride=4,
        batch_size=1,
        precision="fp32",
        device="cpu",
        world_size=1,
        config_digest="d",
        splits={},
        seconds=1.0,
    )
    path = tmp_path / "e.json"
    write_document(path, doc)
    assert read_document(path, EvalReport) == doc
    with pytest.raises(
        DocumentError, match=r"e.json: a 'distlm-eval/2' document where 'distlm-data"
    ):
        read_document(path, DataStats)
    path.write_text(path.read_text().replace("distlm-eval/2", "distlm-eval/1"))
    with pytest.raises(DocumentError, match="written by another version of distlm"):
        read_document(path, EvalReport)
    path.write_text(
        path.read_text()
        .replace("distlm-eval/1", "distlm-eval/2")
        .replace('"seconds": 1.0', '"seconds": 1.0, "extra": 1')
    )
    with pytest.raises(DocumentError, match="field extra"):
        read_document(path, EvalReport)
    with pytest.raises(DocumentError, match="not found"):
        read_document(tmp_path / "none.json", EvalReport)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC.parent / rel).with_suffix(".py").is_file() or (SRC.parent / rel).is_dir()


def _imports(path: Path, module: str) -> set[str]:
    """distlm modules `path` imports, at the top or inside functions."""
    tree = ast.parse(path.read_text())
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("distlm"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("distlm"):
                # `from pkg import submodule` imports the submodule; any other name, pkg itself
                subs = {f"{base}.{a.name}" for a in node.names}
                out.update(subs)
                if not all(_is_module(s) for s in subs):
                    out.add(base)
    return out


def test_no_import_cycles():
    modules = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        modules[name] = p
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}
    # A package's __init__ runs before its submodules: an import of distlm.x.y also runs
    # distlm.x, but that is no edge of the module that asked.
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n] if n in stack else [m, n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_dag_imports_nothing_heavy():
    """The workflow imports distlm.dag.stages and the report's items while it builds the DAG."""
    import subprocess
    import sys

    code = (
        "import sys; import distlm.dag.stages, distlm.report.items, distlm.dag.config, "
        "distlm.inference.prompts; "
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

"""The run identity and its run folders: what a training run is, where its checkpoints live, which
of another run's finished work it may extend, and which runs' checkpoints are kept.

A run's identity (`run_identity`, a `RunIdentity` document) is what changes its weights: the base
model, the data, the topology, the optimiser and the schedule. Each identity has its own folder
`<root>/<run id>/` under the checkpoint root, the first 16 hex digits of the identity's sha256,
with its `identity.json` beside its `step-*` checkpoints (distlm.train.checkpoint):

    run = open_run(root, identity)      # created with identity.json, or reused (marked as used)
    read_identity(run / IDENTITY)       # the one reader; write_identity the one writer

A rerun resumes only its own identity's newest verified checkpoint; an edit that changes the
identity starts a run in another folder and deletes nothing of the others (`prune_runs` keeps the
`keep_runs` most recently used once a run has finished), so reverting an edit finds its finished
work again. The one exception: a run whose identity differs from a *finished* one only in
`max_steps` (more steps) extends it (`extension_source`), as `train.resume: auto` always has.
A checkpoint whose identity differs from this run's is refused with what differs
(`check_identity`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distlm import DistlmError
from distlm.core.documents import read_document, write_document
from distlm.core.log import get_logger
from distlm.data.documents import TokenMeta
from distlm.model.documents import ModelMeta
from distlm.settings.layout_rules import layout_rule
from distlm.train.checkpoint import (
    Checkpoint,
    CheckpointMismatch,
    latest_good,
    list_checkpoints,
    read_state,
    remove_checkpoint,
)
from distlm.train.documents import (
    IdentityData,
    IdentityModel,
    IdentityOptim,
    IdentityTopology,
    RunIdentity,
)

if TYPE_CHECKING:
    from distlm.settings.train import BatchPlan, TrainConfig

log = get_logger(__name__)

IDENTITY = "identity.json"  # in each run folder: the identity its checkpoints belong to
LEGACY_REQUEST = "fresh-run-requested.json"  # written by distlm before run folders; removed
# Identity keys whose difference is tolerated on resume (logged): extending a run is allowed.
TOLERATED = {"optim.max_steps"}


def run_identity(
    cfg: TrainConfig,
    *,
    base: ModelMeta,
    data: TokenMeta,
    block_size: int,
    train_blocks: int,
    plan: BatchPlan,
    precision: str,
) -> RunIdentity:
    """What a checkpoint must share with this run to be resumed (checked key by key), and what
    names its run folder (`RunIdentity.run_id`): the model, data, topology (what the run's
    parallel layout keeps of the batch's cut: distlm.settings.layout_rules) and optimisation."""
    t = cfg.train
    return RunIdentity(
        model=IdentityModel(arch_digest=base.arch_digest, base_model_sha256=base.model_sha256),
        data=IdentityData(
            config_digest=data.config_digest,
            block_size=block_size,
            train_blocks=train_blocks,
            seed=cfg.runtime.seed,
        ),
        topology=IdentityTopology.model_validate(layout_rule(t).identity_topology(plan)),
        optim=IdentityOptim(
            lr=t.lr,
            min_lr=t.min_lr,
            warmup_steps=t.warmup_steps,
            max_steps=t.max_steps,
            weight_decay=t.weight_decay,
            beta1=t.beta1,
            beta2=t.beta2,
            grad_clip=t.grad_clip,
            precision=precision,
        ),
    )


# ----------------------------------------------------------------------------- identity.json


def read_identity(path: str | Path) -> RunIdentity:
    """A run folder's identity.json; a missing, malformed or other kind of file is a
    DocumentError naming it. One written before identity.json carried its format tag (the same
    fields, untagged) reads as version 1, so an upgrade finds its run folders again."""
    return read_document(path, RunIdentity, untagged=True)


def write_identity(path: str | Path, identity: RunIdentity) -> None:
    """Write identity.json atomically (distlm.core.io), with its format tag."""
    write_document(path, identity)


# ----------------------------------------------------------------------------- run folders


def open_run(root: str | Path, identity: RunIdentity) -> Path:
    """The identity's run folder under `root`, created with its identity.json; marked as used now
    (its mtime), which is what `prune_runs` orders by."""
    run = Path(root) / identity.run_id
    meta = run / IDENTITY
    if meta.is_file():
        saved = read_identity(meta)
        if saved != identity:  # a digest collision, or a hand-edited file: never mix runs
            raise CheckpointMismatch(
                f"{meta} holds another identity than its folder name says:\n  "
                + "\n  ".join(identity_diff(saved, identity))
            )
        os.utime(meta)
    else:
        write_identity(meta, identity)
    return run


def list_runs(root: str | Path) -> list[tuple[Path, RunIdentity]]:
    """Run folders under `root` with their identities, most recently used first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        meta = p / IDENTITY
        if p.is_dir() and not p.name.startswith(".") and meta.is_file():
            try:
                found.append((meta.stat().st_mtime, p, read_identity(meta)))
            except (OSError, DistlmError) as e:
                log.warning("ignoring run folder %s: %s", p, e)
    return [(p, ident) for _, p, ident in sorted(found, key=lambda t: -t[0])]


def migrate_legacy(root: str | Path) -> None:
    """Move checkpoints of the layout before run folders (`<root>/step-*`) into their identity's
    folder, so an upgrade resumes (or reuses finished work) instead of training again."""
    root = Path(root)
    for c in list_checkpoints(root):
        try:
            identity = read_state(c).identity
        except DistlmError as e:
            log.warning("legacy checkpoint %s has no readable identity, left alone: %s", c.path, e)
            continue
        run = open_run(root, identity)
        os.replace(c.path, run / c.path.name)
        log.info("moved legacy checkpoint %s into its run folder %s", c.path, run)
    if (root / LEGACY_REQUEST).exists():
        log.warning(
            "ignoring %s (fresh-run requests are gone: set train.resume: never)",
            root / LEGACY_REQUEST,
        )
        (root / LEGACY_REQUEST).unlink(missing_ok=True)


def extension_source(root: str | Path, identity: RunIdentity) -> Checkpoint | None:
    """The newest finished checkpoint of another run that this one may extend: its identity
    differs only in TOLERATED keys (max_steps) and it stopped at its own max_steps, below ours."""
    target = identity.optim.max_steps
    best = None
    for run, other in list_runs(root):
        if run.name == identity.run_id or not identity_diff(other, identity):
            continue
        if hard_diffs(other, identity):
            continue
        found = latest_good(run)
        if found is None or found.step != other.optim.max_steps or found.step >= target:
            continue
        if best is None or found.step > best.step:
            best = found
    return best


def prune_runs(root: str | Path, keep_runs: int, current: Path) -> None:
    """Keep the `keep_runs` most recently used run folders (`current` always); delete the rest."""
    others = [run for run, _ in list_runs(root) if run.resolve() != current.resolve()]
    for run in others[max(0, keep_runs - 1) :]:
        for c in list_checkpoints(run):
            remove_checkpoint(c)
        shutil.rmtree(run, ignore_errors=True)
        log.info("removed the checkpoints of an older run %s (train.keep_runs %d)", run, keep_runs)


# ----------------------------------------------------------------------------- comparing


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def identity_diff(saved: RunIdentity, current: RunIdentity) -> list[str]:
    """Keys whose values differ, as 'key: checkpoint X, this run Y' lines."""
    a, b = _flatten(saved.fields()), _flatten(current.fields())  # a key unset is None
    return [
        f"{k}: checkpoint {a.get(k)!r}, this run {b.get(k)!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]


def hard_diffs(saved: RunIdentity, current: RunIdentity) -> list[str]:
    """The identity differences that forbid a resume (all but the TOLERATED keys)."""
    return [d for d in identity_diff(saved, current) if d.split(":", 1)[0] not in TOLERATED]


def check_identity(ckpt: Checkpoint, saved: RunIdentity, current: RunIdentity) -> None:
    """Refuse a checkpoint made by a different run; tolerate (and log) only TOLERATED keys."""
    diffs = identity_diff(saved, current)
    hard = hard_diffs(saved, current)
    if hard:
        raise CheckpointMismatch(
            f"checkpoint {ckpt.path} was made by a different run and cannot be resumed:\n  "
            + "\n  ".join(hard)
            + f"\nRemove {ckpt.path.parent} (or set train.resume: never) to start afresh."
        )
    for d in diffs:
        log.warning("resuming %s with a changed setting: %s", ckpt.path, d)

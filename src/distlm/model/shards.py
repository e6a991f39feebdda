"""Pipeline folders (rule shard): a model folder cut into S stage shards balanced by bytes, with
shards/manifest.json (layer ranges, tensor names, bytes, sha256 per shard); loading one stage's
shard, or all of them back into one state dict, with every sha256 checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from distlm import DistlmError
from distlm.core.documents import read_document, write_document
from distlm.core.io import atomic_dir, check_sha256, sha256_file
from distlm.core.log import get_logger
from distlm.family import Cut, family_of
from distlm.family.builder import Family
from distlm.model.documents import PipelineMeta, ShardEntry, ShardManifest
from distlm.model.folder import (
    copy_files,
    load_safetensors,
    read_args,
    save_safetensors,
    tensor_nbytes,
    verify_model_folder,
)
from distlm.model.layout import (
    MANIFEST,
    META,
    SHARDS,
    WEIGHTS,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: what it holds of the model (`cut`: decoder layers [start, end), the
    first stage the embeddings, the last the final norm and the head) and those tensors."""

    stage: int
    cut: Cut
    tensors: tuple[str, ...]
    nbytes: int


def plan_stages(
    sd: dict[str, torch.Tensor],
    n_layer: int,
    stages: int,
    *,
    family: Family,
    tied: dict[str, str],
) -> list[StagePlan]:
    """Split decoder layers into `stages` contiguous ranges minimising the largest stage's bytes.

    Stage 0 also holds the embeddings; the last stage the final norm and the LM head (with tied
    embeddings, `tied` = family.tied(config), it holds a copy of the embedding as
    lm_head.weight, counted in its bytes). The family says which tensor is which.
    """
    if not 1 <= stages <= n_layer:
        raise DistlmError(f"inference.stages: {stages} stages for a model with {n_layer} layers")
    block_names: list[list[str]] = [[] for _ in range(n_layer)]
    head, embed = [], []
    for k in sd:
        layer = family.tensors.layer_of(k)
        if layer is not None:
            block_names[layer].append(k)
        elif family.tensors.is_first(k):
            embed.append(k)
        elif family.tensors.is_last(k):
            head.append(k)
        else:
            raise DistlmError(f"tensor {k!r} is no part of a {family.model_type} model")
    copies = [dup for dup in tied if dup not in sd]  # the last stage's copies of tied tensors
    block_bytes = [sum(tensor_nbytes(sd[k]) for k in names) for names in block_names]
    head_bytes = sum(tensor_nbytes(sd[k]) for k in head)
    head_bytes += sum(tensor_nbytes(sd[tied[dup]]) for dup in copies)
    embed_bytes = sum(tensor_nbytes(sd[k]) for k in embed)

    # Exact DP over contiguous partitions (L, S are small): best[s][i] = min max cost of putting
    # blocks [0, i) into stages 0..s.
    L, S = n_layer, stages
    prefix = [0]
    for b in block_bytes:
        prefix.append(prefix[-1] + b)

    def cost(s: int, i: int, j: int) -> int:
        c = prefix[j] - prefix[i]
        if s == 0:
            c += embed_bytes
        if s == S - 1:
            c += head_bytes
        return c

    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(S)]
    cut = [[0] * (L + 1) for _ in range(S)]
    for i in range(1, L + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, S):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(s, i, j))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    bounds, j = [], L
    for s in range(S - 1, -1, -1):
        i = cut[s][j] if s > 0 else 0
        bounds.append((i, j))
        j = i
    bounds.reverse()

    plans = []
    for s, (i, j) in enumerate(bounds):
        names = [k for layer in range(i, j) for k in block_names[layer]]
        if s == 0:
            names = embed + names
        if s == S - 1:
            names = names + head + copies
        plans.append(
            StagePlan(s, Cut(i, j, first=s == 0, last=s == S - 1), tuple(names), cost(s, i, j))
        )
    return plans


def _shard_tensors(
    sd: dict[str, torch.Tensor], plan: StagePlan, tied: dict[str, str]
) -> dict[str, torch.Tensor]:
    out = {}
    for k in plan.tensors:
        if k in sd:
            out[k] = sd[k]
        else:
            out[k] = sd[tied[k]].clone()  # the last stage's own copy of the tied embedding
    return out


def write_pipeline_dir(model_dir: str | Path, out_dir: str | Path, *, stages: int) -> ShardManifest:
    """Cut a model folder into `stages` pipeline shards (rule shard); return the manifest.

    The pipeline folder holds what the pipeline's ranks need and nothing else: config.json, the
    tokenizer, distlm.json (the source folder and its sha256) and shards/ with the manifest. It is
    written atomically, so a killed job leaves no folder that looks complete."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    meta = verify_model_folder(model_dir)
    weights = model_dir / WEIGHTS
    args = read_args(model_dir)
    state_dict = load_safetensors(weights)
    family = family_of(args)
    tied = family.tied(args)
    plans = plan_stages(state_dict, args.n_layers, stages, family=family, tied=tied)
    with atomic_dir(out_dir, size=sum(p.nbytes for p in plans)) as tmp:
        copy_files(model_dir, tmp, skip=(WEIGHTS,))  # config, tokenizer; shards carry weights
        (tmp / SHARDS).mkdir()
        shards = []
        for p in plans:
            fname = f"stage-{p.stage:02d}.safetensors"
            save_safetensors(_shard_tensors(state_dict, p, tied), tmp / SHARDS / fname)
            shards.append(
                ShardEntry(
                    stage=p.stage,
                    file=fname,
                    layers=(p.cut.start, p.cut.end),
                    has_embeddings=p.cut.first,
                    has_head=p.cut.last,
                    tensors=list(p.tensors),
                    bytes=p.nbytes,
                    sha256=sha256_file(tmp / SHARDS / fname),
                )
            )
        manifest = ShardManifest(
            stages=stages,
            n_layer=args.n_layers,
            model_sha256=meta.model_sha256,
            tied=tied,
            shards=shards,
        )
        write_document(tmp / SHARDS / MANIFEST, manifest)
        pipeline = PipelineMeta(
            **meta.model_dump(),
            source_model=str(model_dir),
            stages=[{"stage": s.stage, "layers": list(s.layers), "bytes": s.bytes} for s in shards],
        )
        write_document(tmp / META, pipeline)
    log.info(
        "wrote %s: %d stage shards of %s (layers %s)",
        out_dir,
        stages,
        model_dir,
        ", ".join(f"{s.layers[0]}-{s.layers[1] - 1}" for s in shards),
    )
    return manifest


def read_manifest(folder: str | Path) -> ShardManifest:
    """shards/manifest.json of a pipeline folder (rule shard)."""
    return read_document(Path(folder) / SHARDS / MANIFEST, ShardManifest)


def load_stage_shard(
    folder: str | Path, stage: int, *, device: str = "cpu"
) -> tuple[ShardEntry, dict[str, torch.Tensor]]:
    """(manifest entry, tensors) of one stage, after checking the shard's sha256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    entries = [s for s in manifest.shards if s.stage == stage]
    if not entries:
        raise DistlmError(f"{folder / SHARDS / MANIFEST}: no stage {stage} (has {manifest.stages})")
    entry = entries[0]
    path = folder / SHARDS / entry.file
    check_sha256(
        path,
        entry.sha256,
        named_by=f"the manifest's {entry.sha256} (stage {stage})",
        missing=f"stage {stage}'s shard not found (named by {folder / SHARDS / MANIFEST})",
    )
    tensors = load_safetensors(path, device=device)
    if sorted(tensors) != sorted(entry.tensors):
        raise DistlmError(f"{path}: tensors differ from the manifest's list for stage {stage}")
    return entry, tensors


def load_shards(folder: str | Path) -> dict[str, torch.Tensor]:
    """Reassemble the full state dict from the stage shards (tied copies checked and dropped)."""
    manifest = read_manifest(folder)
    sd: dict[str, torch.Tensor] = {}
    for entry in manifest.shards:
        _, tensors = load_stage_shard(folder, entry.stage)
        sd.update(tensors)
    for dup, src in manifest.tied.items():
        if dup in sd:
            if not torch.equal(sd[dup], sd[src]):
                raise DistlmError(f"{folder}: tied tensor {dup!r} differs from {src!r}")
            del sd[dup]
    return sd

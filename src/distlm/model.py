"""GPT-2-architecture models: build, load, serialize, and split into pipeline-stage shards.

A *model folder* (written by the model stage and by training's final checkpoint) holds:
    model.safetensors        the state dict (tied lm_head.weight omitted, as Hugging Face does)
    config.json              the transformers GPT2Config
    tokenizer files          the tokenizer the token blocks were made with
    distlm.json              provenance: source, config digest, sha256 of model.safetensors
    generation_config.json   what `save_pretrained` writes beside config.json (bos/eos token ids)
It is what `GPT2LMHeadModel.save_pretrained` writes (config.json names `architectures`, the
tokenizer files carry their special tokens), so `AutoModelForCausalLM.from_pretrained(folder)`,
`transformers serve` and vLLM load it as it is.

A *pipeline folder* (rule shard, `write_pipeline_dir`) is a model folder cut for S pipeline
stages: config.json, the tokenizer, distlm.json (the source folder and its sha256) and
    shards/manifest.json     S pipeline stages: layer ranges, tensor names, bytes, sha256 per shard
    shards/stage-XX.safetensors
"""

from __future__ import annotations

import copy
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from distlm import DistlmError
from distlm.io import atomic_dir, digest, read_json, sha256_file, write_json
from distlm.log import get_logger
from distlm.settings import ModelInitSettings, ModelSettings, ModelSourceSettings

log = get_logger(__name__)

WEIGHTS = "model.safetensors"
ARCHITECTURE = "GPT2LMHeadModel"  # config.json's `architectures`: every folder holds a GPT-2 LM
META = "distlm.json"
SHARDS = "shards"
MANIFEST = "manifest.json"
TIED = {"lm_head.weight": "transformer.wte.weight"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BLOCK = re.compile(r"^transformer\.h\.(\d+)\.")


# ----------------------------------------------------------------------------- build / load


def init_config(init: ModelInitSettings, vocab_size: int, eos_token_id: int | None):
    """The GPT-2 architecture of a random init (`model.init`) for this vocabulary."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=init.n_positions,
        n_embd=init.n_embd,
        n_layer=init.n_layer,
        n_head=init.n_head,
        resid_pdrop=init.dropout,
        embd_pdrop=init.dropout,
        attn_pdrop=init.dropout,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
    )


def build_model(config, *, seed: int | None = None):
    """A GPT2LMHeadModel with SDPA attention; seeded random init when `seed` is given."""
    from transformers import GPT2LMHeadModel

    config._attn_implementation = "sdpa"
    if seed is not None:
        torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def load_source(mcfg: ModelSourceSettings):
    """Model from a hub id or a local HF folder, in float32; errors name the id or folder."""
    from transformers import GPT2LMHeadModel

    name, local = mcfg.name, mcfg.source == "local"
    if not name:  # Settings refuses this
        raise DistlmError(f"model.name: required when model.source is {mcfg.source}")
    if local and not Path(name).is_dir():
        raise DistlmError(f"model.name: model folder not found: {name}")
    try:
        model = GPT2LMHeadModel.from_pretrained(
            name,
            revision=mcfg.revision or "main",  # transformers' own default
            local_files_only=local,
            torch_dtype=torch.float32,
            attn_implementation="sdpa",
        )
    except Exception as e:
        hint = "" if local else " Unknown model id, or offline without a cached copy?"
        raise DistlmError(
            f"model.name {name!r}: could not load the model ({type(e).__name__}: {e}).{hint}"
        ) from None
    if model.config.model_type != "gpt2":
        raise DistlmError(f"model.name {name!r}: model_type {model.config.model_type!r}, need gpt2")
    return model


def state_dict_for_save(model) -> dict[str, torch.Tensor]:
    """The model's state dict without tied duplicates, contiguous, on the CPU."""
    sd = model.state_dict()
    for dup, src in TIED.items():
        if dup in sd and src in sd and model.config.tie_word_embeddings:
            del sd[dup]
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def load_safetensors(path: str | Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file; a corrupt or truncated file gets an error that names it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DistlmError(f"weights file not found: {path}")
    try:
        return load_file(str(path), device=device)
    except Exception as e:
        raise DistlmError(
            f"{path}: corrupt or truncated safetensors file ({type(e).__name__}: {e})"
        ) from None


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None
) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_config_json(folder: str | Path):
    from transformers import GPT2Config

    p = Path(folder) / "config.json"
    if not p.is_file():
        raise DistlmError(f"model config not found: {p}")
    try:
        return GPT2Config.from_json_file(str(p))
    except Exception as e:
        raise DistlmError(f"{p}: not a readable GPT-2 config ({e})") from None


def check_state_dict(
    sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str
) -> None:
    """Names, shapes and dtypes of `sd` must match `expected`; the error names the tensor."""
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing:
        raise DistlmError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    if extra:
        raise DistlmError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected)")
    for k, v in expected.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise DistlmError(
                f"{where}: tensor {k!r} has shape {tuple(sd[k].shape)}, config expects {tuple(v.shape)}"
            )


def load_model_dir(
    folder: str | Path, *, device: str | torch.device = "cpu", dtype=None, verify: bool = True
):
    """Load a model folder into a GPT2LMHeadModel (eval mode); checks digest and tensor shapes."""
    folder = Path(folder)
    config = load_config_json(folder)
    weights = folder / WEIGHTS
    if verify:
        meta = read_meta(folder)
        actual = sha256_file(weights) if weights.is_file() else None
        if meta.get("model_sha256") and actual != meta["model_sha256"]:
            raise DistlmError(
                f"{weights}: sha256 {actual} does not match {folder / META} ({meta['model_sha256']})"
            )
    sd = load_safetensors(weights)
    with torch.device("meta"):
        model = build_model(config)
    expected = {
        k: v
        for k, v in model.state_dict().items()
        if not (k in TIED and config.tie_word_embeddings)
    }
    check_state_dict(sd, expected, str(weights))
    model = build_model(config)
    model.load_state_dict(sd, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


MODEL_FORMAT = "distlm-model/1"
PIPELINE_FORMAT = "distlm-pipeline/1"
SHARDS_FORMAT = "distlm-shards/1"


def _checked(path: Path, what: str, fmt: str) -> dict:
    """A JSON document of this format and version, or an error naming the file."""
    doc = read_json(path, what=what)
    found = doc.get("format") if isinstance(doc, dict) else None
    if found != fmt:
        raise DistlmError(
            f"{path}: {what} of format {found!r}, expected {fmt!r}; rerun the stage that wrote it"
        )
    return doc


def read_meta(folder: str | Path) -> dict:
    """distlm.json of a model folder (the model stage's or training's final)."""
    return _checked(Path(folder) / META, "model metadata", MODEL_FORMAT)


# ----------------------------------------------------------------------------- stage shards


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: transformer blocks [layer_start, layer_end) and the tensors it holds."""

    stage: int
    layer_start: int
    layer_end: int
    tensors: tuple[str, ...]
    nbytes: int

    @property
    def has_embeddings(self) -> bool:
        return "transformer.wte.weight" in self.tensors

    @property
    def has_head(self) -> bool:
        return "transformer.ln_f.weight" in self.tensors


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_stages(
    sd: dict[str, torch.Tensor], n_layer: int, stages: int, *, tied: bool = True
) -> list[StagePlan]:
    """Split blocks into `stages` contiguous ranges minimising the largest stage's bytes.

    Stage 0 also holds the embeddings (wte, wpe); the last stage the final norm and the LM head
    (with tied embeddings it holds a copy of wte as lm_head.weight, counted in its bytes).
    """
    if not 1 <= stages <= n_layer:
        raise DistlmError(f"inference.stages: {stages} stages for a model with {n_layer} layers")
    block_names: list[list[str]] = [[] for _ in range(n_layer)]
    head, embed = [], []
    for k in sd:
        m = _BLOCK.match(k)
        if m:
            block_names[int(m.group(1))].append(k)
        elif k.startswith(("transformer.wte.", "transformer.wpe.")):
            embed.append(k)
        else:
            head.append(k)
    block_bytes = [sum(_nbytes(sd[k]) for k in names) for names in block_names]
    head_bytes = sum(_nbytes(sd[k]) for k in head)
    if tied and "lm_head.weight" not in sd:
        head_bytes += _nbytes(sd["transformer.wte.weight"])
    embed_bytes = sum(_nbytes(sd[k]) for k in embed)

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
            names = (
                names + head + (["lm_head.weight"] if tied and "lm_head.weight" not in sd else [])
            )
        plans.append(StagePlan(s, i, j, tuple(names), cost(s, i, j)))
    return plans


def _shard_tensors(sd: dict[str, torch.Tensor], plan: StagePlan) -> dict[str, torch.Tensor]:
    out = {}
    for k in plan.tensors:
        if k in sd:
            out[k] = sd[k]
        elif k in TIED:
            out[k] = sd[TIED[k]].clone()  # the last stage's own copy of the tied embedding
    return out


def write_model_dir(
    out_dir: str | Path,
    *,
    state_dict: dict[str, torch.Tensor],
    config,
    tokenizer_dir: str | Path,
    meta: dict,
    extra_files: dict[str, Path] | None = None,
) -> dict:
    """Write a complete model folder (atomically: all or nothing) and return its metadata."""
    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise DistlmError(f"tokenizer folder not found: {tokenizer_dir}")
    with atomic_dir(out_dir) as tmp:
        save_safetensors(state_dict, tmp / WEIGHTS, metadata={"format": "pt"})
        save_config(config, tmp, dtype=next(iter(state_dict.values())).dtype)
        _copy_files(tokenizer_dir, tmp)
        for name, src in (extra_files or {}).items():
            shutil.copy2(src, tmp / name)
        full_meta = {
            "format": MODEL_FORMAT,
            **meta,
            "model_sha256": sha256_file(tmp / WEIGHTS),
            "n_layer": config.n_layer,
            "n_positions": config.n_positions,
            "vocab_size": config.vocab_size,
            "parameters": sum(t.numel() for t in state_dict.values()),
            "arch_digest": digest(arch_signature(config)),
        }
        write_json(tmp / META, full_meta)
    log.info(
        "wrote %s: %d tensors, %.1f MB",
        out_dir,
        len(state_dict),
        sum(_nbytes(t) for t in state_dict.values()) / 1e6,
    )
    return full_meta


def save_config(config, folder: Path, *, dtype: torch.dtype) -> None:
    """config.json and generation_config.json as `GPT2LMHeadModel.save_pretrained` writes them.

    `architectures` is what the ecosystem picks the model class by (`transformers serve` does
    `getattr(transformers, config.architectures[0])`, and so does vLLM); a config built from
    scratch (model.source init) has none until a model saves it."""
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    config.architectures = [ARCHITECTURE]
    config.dtype = dtype
    config.save_pretrained(folder)
    gen = GenerationConfig.from_model_config(config)
    gen._from_model_config = True  # as save_pretrained marks it: defaults, no user settings
    gen.save_pretrained(folder)


def _copy_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy2(f, dst / f.name)


def write_pipeline_dir(model_dir: str | Path, out_dir: str | Path, *, stages: int) -> dict:
    """Cut a model folder into `stages` pipeline shards (rule shard); return the manifest.

    The pipeline folder holds what the pipeline's ranks need and nothing else: config.json, the
    tokenizer, distlm.json (the source folder and its sha256) and shards/ with the manifest. It is
    written atomically, so a killed job leaves no folder that looks complete."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    meta = read_meta(model_dir)
    weights = model_dir / WEIGHTS
    actual = sha256_file(weights) if weights.is_file() else None
    if actual is None or actual != meta.get("model_sha256"):
        raise DistlmError(
            f"{weights}: sha256 {actual} does not match {model_dir / META} "
            f"({meta.get('model_sha256')})"
        )
    config = load_config_json(model_dir)
    state_dict = load_safetensors(weights)
    plans = plan_stages(state_dict, config.n_layer, stages, tied=config.tie_word_embeddings)
    with atomic_dir(out_dir) as tmp:
        _copy_files(model_dir, tmp, skip=(WEIGHTS,))  # config, tokenizer; shards carry weights
        (tmp / SHARDS).mkdir()
        shards = []
        for p in plans:
            fname = f"stage-{p.stage:02d}.safetensors"
            save_safetensors(_shard_tensors(state_dict, p), tmp / SHARDS / fname)
            shards.append(
                {
                    "stage": p.stage,
                    "file": fname,
                    "layers": [p.layer_start, p.layer_end],
                    "has_embeddings": p.has_embeddings,
                    "has_head": p.has_head,
                    "tensors": list(p.tensors),
                    "bytes": p.nbytes,
                    "sha256": sha256_file(tmp / SHARDS / fname),
                }
            )
        manifest = {
            "format": SHARDS_FORMAT,
            "stages": stages,
            "n_layer": config.n_layer,
            "model_sha256": actual,
            "tied": dict(TIED) if config.tie_word_embeddings else {},
            "shards": shards,
        }
        write_json(tmp / SHARDS / MANIFEST, manifest)
        write_json(
            tmp / META,
            {
                **meta,
                "format": PIPELINE_FORMAT,
                "source_model": str(model_dir),
                "stages": [
                    {"stage": s["stage"], "layers": s["layers"], "bytes": s["bytes"]}
                    for s in shards
                ],
            },
        )
    log.info(
        "wrote %s: %d stage shards of %s (layers %s)",
        out_dir,
        stages,
        model_dir,
        ", ".join(f"{s['layers'][0]}-{s['layers'][1] - 1}" for s in shards),
    )
    return manifest


def arch_signature(config) -> dict:
    """What must agree between a checkpoint and the model it claims to be."""
    return {
        k: getattr(config, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    }


def read_manifest(folder: str | Path) -> dict:
    """shards/manifest.json of a pipeline folder (rule shard)."""
    return _checked(Path(folder) / SHARDS / MANIFEST, "shard manifest", SHARDS_FORMAT)


def load_stage_shard(
    folder: str | Path, stage: int, *, device: str = "cpu"
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest entry, tensors) of one stage, after checking the shard's sha256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    entries = [s for s in manifest["shards"] if s["stage"] == stage]
    if not entries:
        raise DistlmError(
            f"{folder / SHARDS / MANIFEST}: no stage {stage} (has {manifest['stages']})"
        )
    entry = entries[0]
    path = folder / SHARDS / entry["file"]
    if not path.is_file():
        raise DistlmError(f"stage shard not found: {path}")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise DistlmError(
            f"{path}: sha256 {actual} does not match the manifest's {entry['sha256']} (stage {stage})"
        )
    tensors = load_safetensors(path, device=device)
    if sorted(tensors) != sorted(entry["tensors"]):
        raise DistlmError(f"{path}: tensors differ from the manifest's list for stage {stage}")
    return entry, tensors


def load_shards(folder: str | Path) -> dict[str, torch.Tensor]:
    """Reassemble the full state dict from the stage shards (tied copies checked and dropped)."""
    manifest = read_manifest(folder)
    sd: dict[str, torch.Tensor] = {}
    for entry in manifest["shards"]:
        _, tensors = load_stage_shard(folder, entry["stage"])
        sd.update(tensors)
    for dup, src in manifest["tied"].items():
        if dup in sd:
            if not torch.equal(sd[dup], sd[src]):
                raise DistlmError(f"{folder}: tied tensor {dup!r} differs from {src!r}")
            del sd[dup]
    return sd


def serialize(
    mcfg: ModelSettings, *, tokenizer_dir: Path, tokens_path: Path, out_dir: Path
) -> dict:
    """The model stage (`model`): hub id / local folder / seeded init -> model folder."""
    from distlm.data import read_tokens_meta as read_data_meta

    data_meta = read_data_meta(tokens_path)
    vocab = data_meta["vocab_size"]
    if mcfg.source == "init":
        config = init_config(mcfg.init, vocab, data_meta.get("eos_token_id"))
        model = build_model(config, seed=mcfg.init.seed)
        source = {"kind": "init", "seed": mcfg.init.seed}
    else:
        model = load_source(mcfg)
        config = model.config
        source = mcfg.model_dump(include={"source", "name", "revision"})
        if config.vocab_size < vocab:
            raise DistlmError(
                f"model.name {mcfg.name!r} has vocab_size {config.vocab_size} but the tokenizer in "
                f"{tokenizer_dir} has {vocab} tokens"
            )
    if data_meta["block_size"] > config.n_positions:
        raise DistlmError(
            f"data.block_size: {data_meta['block_size']} ({tokens_path}) is beyond model "
            f"{mcfg.name or 'init'}'s context of {config.n_positions}"
        )
    model = model.to(DTYPES[mcfg.dtype])
    sd = state_dict_for_save(model)
    meta = {
        "created_by": "model",
        "source": source,
        "config_digest": digest({"model": mcfg.model_dump()}),
        "data_config_digest": data_meta["config_digest"],
        "dtype": mcfg.dtype,
    }
    return write_model_dir(
        out_dir, state_dict=sd, config=config, tokenizer_dir=tokenizer_dir, meta=meta
    )

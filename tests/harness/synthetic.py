"""Small synthetic inputs for tests and benchmarks: a token file and a model folder, in seconds.

The token stream follows a noisy affine recurrence (next = a*prev + b mod V, with a few random
tokens), so a model can learn it and the loss visibly falls within a handful of steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from distlm.core.io import digest
from distlm.dag.stages import STAGES
from distlm.data.documents import (
    SPLITS,
    ShardMeta,
    ShardSpec,
    ShardSplit,
    Source,
    TokenMeta,
    Unit,
)
from distlm.data.tokens import ShardWriter, stream_segments, token_dtype, write_index
from distlm.model import init_config, init_model, state_dict_for_save, write_model_dir
from distlm.settings import init_settings


def write_tokens(
    path: str | Path, streams: dict[str, np.ndarray], block_size: int, vocab: int, meta: TokenMeta
) -> Path:
    """A token store of `streams` (split -> ids) as the data stage lays it out: one shard file
    under path's folder (shards/) holding every split, and the index at `path`; returns the
    shard's path. The meta's block size and vocabulary are the file's."""
    path = Path(path)
    assert meta.block_size == block_size and meta.vocab_size == vocab
    dtype = token_dtype(vocab)
    unit = Unit(file="synthetic", format="txt", size=0, start=0, stop=0, text_bytes=0)
    spec = ShardSpec(
        source=Source(kind="local", units=(unit,), split="train", text_field="text"),
        separator="",
        tokenizer=meta.config_digest[:16],
    )
    shard = path.parent / "shards" / f"{spec.id}.h5"
    empty = np.zeros(0, dtype=dtype)
    with ShardWriter(shard, dtype) as w:
        for s in SPLITS:
            w.add(s, streams.get(s, empty))
        n = {s: len(streams.get(s, empty)) for s in SPLITS}
        w.finish(
            ShardMeta(
                spec=spec,
                vocab_size=vocab,
                dtype=dtype.str,
                splits={
                    s: ShardSplit(
                        records=int(n[s] > 0),
                        documents=int(n[s] > 0),
                        text_bytes=0,
                        tokens=n[s],
                        last_piece=0,
                        last=0,
                    )
                    for s in SPLITS
                },
                seconds=0.0,
                tokens_per_s=0.0,
                peak_rss_bytes=0,
            ),
            {s: empty for s in SPLITS},
        )
    from distlm.data.tokens import read_shard_meta

    shards = [(shard, read_shard_meta(shard))]
    segments = {s: stream_segments(shards, s) for s in SPLITS if s in streams}
    write_index(path, segments, meta=meta, dtype=dtype)
    return shard


def synthetic_stream(n_tokens: int, vocab: int, *, seed: int, noise: float = 0.05) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty(n_tokens, dtype=np.int64)
    out[0] = 0
    rand = rng.integers(0, vocab, n_tokens)
    flip = rng.random(n_tokens) < noise
    for i in range(1, n_tokens):
        out[i] = rand[i] if flip[i] else (5 * out[i - 1] + 3) % vocab
    return out


def make_inputs(
    root: str | Path,
    *,
    vocab: int = 256,
    block_size: int = 32,
    train_blocks: int = 64,
    val_blocks: int = 16,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 32,
    n_positions: int | None = None,
    seed: int = 0,
    **arch,
) -> dict[str, Path]:
    """Write root/tokens.h5, root/tokenizer/ (empty) and root/model/; return their paths. `arch`:
    more model.init keys (architecture llama, n_kv_head, ...)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    streams = {
        "train": synthetic_stream(train_blocks * block_size, vocab, seed=seed),
        "validation": synthetic_stream(val_blocks * block_size, vocab, seed=seed + 1),
        "test": synthetic_stream(val_blocks * block_size, vocab, seed=seed + 2),
    }
    data_cfg = {
        "synthetic": True,
        "vocab": vocab,
        "block_size": block_size,
        "train_blocks": train_blocks,
        "val_blocks": val_blocks,
        "seed": seed,
    }
    meta = {
        "source": {"kind": "synthetic"},
        "config_digest": digest(data_cfg),
        "tokenizer": "none",
        "vocab_size": vocab,
        "eos_token_id": 0,
        "block_size": block_size,
    }
    tokens = root / STAGES["data"].file("tokens")
    write_tokens(tokens, streams, block_size, vocab, TokenMeta(**meta))
    tokenizer = root / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    init = init_settings(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=n_positions or block_size,
        dropout=0.0,
        seed=seed,
        **arch,
    )
    config = init_config(init, vocab, 0)
    model = init_model(config, seed=seed)
    write_model_dir(
        root / "model",
        state_dict=state_dict_for_save(model),
        config=config,
        tokenizer_dir=tokenizer,
        meta={
            "created_by": "synthetic",
            "source": {"kind": "init", "seed": seed},
            "config_digest": digest(init.model_dump()),
            "data_config_digest": meta["config_digest"],
            "dtype": "float32",
        },
    )
    return {"tokens": tokens, "tokenizer": tokenizer, "model": root / "model"}


def run_identity(*, arch_digest: str = "a" * 64, max_steps: int = 10, lr: float = 0.1):
    """A training run's identity (distlm.train.identity) with fixed digests and sizes."""
    from distlm.train.documents import (
        IdentityData,
        IdentityModel,
        IdentityOptim,
        IdentityTopology,
        RunIdentity,
    )

    return RunIdentity(
        model=IdentityModel(arch_digest=arch_digest, base_model_sha256="b" * 64),
        data=IdentityData(config_digest="c" * 64, block_size=32, train_blocks=64, seed=0),
        topology=IdentityTopology(world_size=1, micro_batch=4, grad_accum=1, global_batch=4),
        optim=IdentityOptim(
            lr=lr,
            min_lr=0,
            warmup_steps=2,
            max_steps=max_steps,
            weight_decay=0.1,
            beta1=0.9,
            beta2=0.95,
            grad_clip=1.0,
            precision="fp32",
        ),
    )


def checkpoint_state(step: int, identity=None):
    """A checkpoint's training state (the save path's document) with nothing but its step (and
    the harness's run identity)."""
    from distlm.train.documents import CheckpointState

    return CheckpointState(
        identity=identity or run_identity(),
        data={},
        scheduler={},
        scaler={},
        metrics={},
        distlm_version="test",
        step=step,
    )


def corpus_model_folder(
    folder: Path,
    init,
    *,
    texts: int | None = None,
    vocab: int = 4096,
    min_frequency: int = 2,
    created_by: str,
    spread: float | None = None,
) -> Path:
    """folder/model: a seeded model of `init` (model.init's settings) with a tokenizer trained on
    the embedded corpus (its first `texts` documents; None: all), built and written by the model
    stage's own functions (folder/tokenizer beside it). `spread`: the weights drawn again, wider
    than the init's (a second seed), so that greedy decoding varies. What the inference tests
    and benchmarks serve."""
    import torch

    from distlm.data import load_embedded, train_tokenizer

    tokdir = folder / "tokenizer"
    docs = load_embedded() if texts is None else load_embedded()[:texts]
    tok = train_tokenizer([t for _, t in docs], vocab, min_frequency, tokdir)
    if not isinstance(tok.eos_token_id, int):
        raise SystemExit(f"tokenizer {tokdir}: eos_token_id {tok.eos_token_id!r} is not one id")
    cfg = init_config(init, len(tok), tok.eos_token_id)
    model = init_model(cfg, seed=0)
    if spread is not None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                base = 1.0 if ".ln" in name and name.endswith("weight") else 0.0
                p.copy_(base + torch.randn(p.shape, generator=g) * (spread if p.dim() > 1 else 0.1))
    write_model_dir(
        folder / "model",
        state_dict=state_dict_for_save(model),
        config=cfg,
        tokenizer_dir=tokdir,
        meta={
            "created_by": created_by,
            "source": {"kind": "init", "seed": 0},
            "config_digest": "0" * 64,
            "data_config_digest": "0" * 64,
            "dtype": "float32",
        },
    )
    return folder / "model"

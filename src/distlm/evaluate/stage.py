"""Checkpoint evaluation: sliding-window perplexity, windows split across ranks, exact reduction.

    torchrun --standalone --nproc-per-node=2 -m distlm.entry.evaluate \
        --config results/config/eval.json --model results/model/base \
        --tokens results/data/tokens.h5 --name base --out results/eval/base.json

Method: the Hugging Face guide "Perplexity of fixed-length models". A split is one token stream
of N tokens. Window k feeds tokens [k*stride, min(k*stride + context, N)) to the model (positions
restart at 0 in every window) and scores only the tokens the previous window did not reach, so
with stride < context every scored token sees at least context - stride tokens of history. The
first token of a window that starts where the previous one ended has no history in it and is not
scored (nor is token 0 of the stream); windows stop at the first one that reaches the end, so a
stream shorter than the context is one shorter window.

    perplexity = exp( sum of -log p(token | its window's history) / tokens scored )

Distribution: window k belongs to rank k % world_size. Every rank adds the float32 per-token
losses of its windows into a float64 sum; one all-reduce of (sum, count) gives the token-weighted
mean, so the result does not depend on the world size (only on float32 rounding inside a forward,
which is the same for a window whatever rank runs it, up to batch-shape effects ~1e-7).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.core.io import sha256_file
from distlm.core.log import get_logger, progress
from distlm.data.documents import TokenMeta
from distlm.evaluate.documents import EvalReport, SplitEval
from distlm.family.transformer import Transformer
from distlm.model.documents import ModelMeta
from distlm.runtime.device import autocast
from distlm.settings import EvalSettings
from distlm.settings.eval import EvalConfig

log = get_logger(__name__)

METHOD = "sliding-window perplexity (Hugging Face guide 'Perplexity of fixed-length models')"


@dataclass(frozen=True)
class Window:
    """Input tokens [begin, end) of the stream; tokens [target, end) are scored."""

    begin: int
    end: int
    target: int

    @property
    def n_scored(self) -> int:
        return self.end - self.target


def sliding_windows(
    n_tokens: int, context: int, stride: int, *, where: str = "split"
) -> list[Window]:
    """The windows of a stream of `n_tokens` tokens (HF guide's loop, token 0 never scored)."""
    if context < 2:
        raise DistlmError(f"eval.context: {context} tokens; at least 2 are needed to score one")
    if not 1 <= stride <= context:
        raise DistlmError(f"eval.stride: {stride} must be between 1 and eval.context ({context})")
    if n_tokens < 2:
        raise DistlmError(f"{where}: {n_tokens} token(s); at least 2 are needed to score one")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def resolve_window(
    ecfg: EvalSettings, n_positions: int, *, where: str = "model"
) -> tuple[int, int]:
    """(context, stride) from the eval config: context null = n_positions, stride null = context."""
    context = ecfg.context if ecfg.context is not None else n_positions
    if context > n_positions:
        raise DistlmError(
            f"eval.context: {context} is beyond the context of {where} ({n_positions} positions)"
        )
    stride = ecfg.stride if ecfg.stride is not None else context
    if stride > context:
        raise DistlmError(f"eval.stride: {stride} is larger than the context of {context} tokens")
    return context, stride


def precision_name(dtype: torch.dtype | None) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _batch(tokens: torch.Tensor, windows: list[Window]):
    """Right-padded inputs (B, T), the mask of positions whose next token is scored, the labels."""
    width = max(w.end - w.begin for w in windows)
    ids = torch.zeros(len(windows), width, dtype=torch.long)  # padding sits after every real token,
    labels = torch.zeros(len(windows), width, dtype=torch.long)  # so causal attention never sees it
    scored = torch.zeros(len(windows), width, dtype=torch.bool)
    for j, w in enumerate(windows):
        n = w.end - w.begin
        ids[j, :n] = tokens[w.begin : w.end]
        labels[j, : n - 1] = tokens[w.begin + 1 : w.end]
        scored[j, w.target - w.begin - 1 : n - 1] = True  # position p predicts token begin + p + 1
    return ids, scored, labels


@torch.no_grad()
def score_windows(
    model: Transformer,
    tokens: torch.Tensor,
    windows: list[Window],
    *,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    show_progress: bool = False,
    desc: str = "eval",
) -> tuple[torch.Tensor, int]:
    """(float64 sum of token losses, tokens scored) over `windows`, `batch_size` windows at a time.

    The LM head runs only on the positions that are scored (a stride-512 window scores half of its
    1024 positions), and the loss is taken in float32 whatever the autocast dtype.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    amp = autocast(device, autocast_dtype)
    starts = range(0, len(windows), batch_size)
    for i in progress(starts, enabled=show_progress, desc=desc, unit="batch"):
        ids, scored, labels = _batch(tokens, windows[i : i + batch_size])
        ids, scored, labels = ids.to(device), scored.to(device), labels.to(device)
        with amp:
            # distlm's model of the family (distlm.family): its logits on the scored positions
            hidden = model(ids, head=False)  # (B, T, C)
            logits = model.logits(hidden[scored])  # (n_scored, V)
        nll = F.cross_entropy(logits.float(), labels[scored], reduction="none")  # (n_scored,)
        total += nll.double().sum()
        count += nll.numel()
    return total, count


def evaluate_stream(
    model: Transformer,
    tokens: np.ndarray | torch.Tensor,
    *,
    context: int,
    stride: int,
    batch_size: int,
    topo,
    autocast_dtype: torch.dtype | None = None,
    where: str = "split",
) -> SplitEval:
    """Sliding-window perplexity of one token stream, this rank's share of windows, reduced."""
    tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    vocab = model.args.vocab_size
    if len(tokens) and (int(tokens.max()) >= vocab or int(tokens.min()) < 0):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab else int(tokens.min())
        raise DistlmError(f"{where}: token id {bad} is outside the model's vocabulary of {vocab}")
    windows = sliding_windows(len(tokens), context, stride, where=where)
    mine = windows[topo.rank :: topo.world_size]
    topo.barrier()
    t0 = time.perf_counter()
    total, count = score_windows(
        model,
        tokens,
        mine,
        batch_size=batch_size,
        device=topo.device,
        autocast_dtype=autocast_dtype,
        show_progress=topo.is_main,
        desc=where,
    )
    sums = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=topo.device)])
    if dist.is_initialized() and topo.world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    seconds = time.perf_counter() - t0  # the all-reduce waits for the slowest rank
    nll_sum, n_scored = float(sums[0]), round(float(sums[1]))
    expected = sum(w.n_scored for w in windows)
    if n_scored != expected:  # every window scored exactly once, across all ranks
        raise DistlmError(f"{where}: {n_scored} tokens scored across ranks, expected {expected}")
    mean = nll_sum / n_scored
    if not math.isfinite(mean):
        raise DistlmError(
            f"{where}: mean loss is {mean} (precision {precision_name(autocast_dtype)}); "
            "try eval.precision: fp32"
        )
    return SplitEval(
        mean_loss=mean,
        perplexity=math.exp(mean),
        tokens_scored=n_scored,
        tokens=len(tokens),
        windows=len(windows),
        context=context,
        stride=stride,
        seconds=round(seconds, 4),
        tokens_per_s=round(n_scored / seconds, 1) if seconds > 0 else None,
        tokens_sha256=digest_tokens(tokens),
    )


def digest_tokens(tokens: np.ndarray | torch.Tensor) -> str:
    """sha256 of the stream as int64 bytes: the same figure as `tokens_sha256` in stats.json."""
    import hashlib

    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


def load_model(model_dir: str | Path, device: torch.device) -> tuple[Transformer, ModelMeta]:
    """distlm's model of the folder in float32 (digest and tensor shapes verified) and its
    metadata."""
    from distlm.model import load_model_dir, verify_model_folder

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise DistlmError(f"model folder not found: {model_dir}")
    meta = verify_model_folder(model_dir)
    model = load_model_dir(model_dir, device=device, dtype=torch.float32, verify=False)
    return model, meta


def check_data_matches(
    model_meta: ModelMeta, data_meta: TokenMeta, model_dir: Path, tokens_path: Path
) -> None:
    """A model made from other token blocks (another tokenizer) would be scored on the wrong ids."""
    want = model_meta.data_config_digest
    have = data_meta.config_digest
    if want != have:
        raise DistlmError(
            f"{model_dir}: made from data with config digest {want[:12]}, but {tokens_path} has "
            f"{have[:12]}: rerun the model stage or point eval at the matching tokens"
        )


def evaluate_model(
    cfg: EvalConfig,
    *,
    topo,
    model_dir: str | Path,
    tokens_path: str | Path,
    name: str,
    out_path: str | Path,
) -> EvalReport | None:
    """The eval stage for one model: every split in eval.splits; rank 0 writes `out_path` and
    returns the report (None on the other ranks)."""
    from distlm.data import TokenBlocks
    from distlm.data import read_tokens_meta as read_data_meta

    model_dir, tokens_path, ecfg = Path(model_dir), Path(tokens_path), cfg.eval
    t0 = time.perf_counter()
    model, meta = load_model(model_dir, topo.device)
    data_meta = read_data_meta(tokens_path)
    check_data_matches(meta, data_meta, model_dir, tokens_path)
    n_positions = model.args.context
    context, stride = resolve_window(ecfg, n_positions, where=str(model_dir))
    amp = (
        topo.device_backend.autocast_dtype
    )  # eval.precision on this device (distlm.runtime.device)
    log.info(
        "%s (%s): context %d, stride %d, batch %d windows, %s on %s, %d rank(s)",
        name,
        model_dir,
        context,
        stride,
        ecfg.batch_size,
        precision_name(amp),
        topo.device,
        topo.world_size,
    )
    splits = {}
    for split in ecfg.splits:
        tokens = TokenBlocks(tokens_path, split).tokens()
        res = evaluate_stream(
            model,
            tokens,
            context=context,
            stride=stride,
            batch_size=ecfg.batch_size,
            topo=topo,
            autocast_dtype=amp,
            where=f"{tokens_path} split {split!r}",
        )
        res = res.model_copy(update={"model_sha256": meta.model_sha256})
        splits[split] = res
        if topo.is_main:
            log.info(
                "%s %s: loss %.4f, perplexity %.3f over %d tokens (%d windows) in %.2f s, "
                "%s tokens/s",
                name,
                split,
                res.mean_loss,
                res.perplexity,
                res.tokens_scored,
                res.windows,
                res.seconds,
                res.tokens_per_s,
            )
    result = {
        "name": name,
        "method": METHOD,
        "model": {
            "path": str(model_dir),
            "model_sha256": meta.model_sha256,
            "arch_digest": meta.arch_digest,
            "created_by": meta.created_by,
            "parameters": meta.parameters,
            "n_positions": n_positions,
        },
        "data": {
            "path": str(tokens_path),
            "config_digest": data_meta.config_digest,
            "vocab_size": data_meta.vocab_size,
        },
        "context": context,
        "stride": stride,
        "batch_size": ecfg.batch_size,
        "precision": precision_name(amp),
        "device": str(topo.device.type),
        "world_size": topo.world_size,
        "config_digest": cfg.digest,
        "splits": splits,
    }
    report = None
    if topo.is_main:
        result["data"]["sha256"] = sha256_file(tokens_path)
        report = EvalReport(**result, seconds=round(time.perf_counter() - t0, 3))
        write_document(out_path, report)
        log.info("wrote %s", out_path)
    topo.barrier()
    return report

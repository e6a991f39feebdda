"""A tokenize job (rule tokenize_shard): one shard's records -> its token shard file.

Records are read as a stream (distlm.data.sources), dealt to their splits, joined by the
separator (each record followed by it, tokenized record by record, as one process tokenizing the
whole split would), encoded in batches by the tokenizers library and written as they are made, in
the token dtype (distlm.data.tokens.ShardWriter): a job's memory is one batch, whatever the
shard's size. A progress bar (stderr) and a log line every half minute give bytes, tokens a second
and the time left.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np

from distlm.core.log import get_logger, progress
from distlm.data.documents import SPLITS, ShardMeta, ShardSpec, ShardSplit, SplitName
from distlm.data.sources import records
from distlm.data.tokenizer import Encoder
from distlm.data.tokens import ShardWriter, token_dtype

log = get_logger(__name__)

BATCH_BYTES = 1 << 20  # text encoded at a time, per split
BATCH_RECORDS = 1024
LOG_EVERY_S = 30.0


class _Split:
    """What a job has seen of one split: the pending batch, counts, its last record."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.pending_bytes = 0
        self.records = 0
        self.documents = 0
        self.text_bytes = 0
        self.tokens = 0
        self.last_piece = 0
        self.last: str | None = None


def tokenize_shard(
    spec: ShardSpec, *, tokenizer_dir: str | Path, out_path: str | Path, threads: int = 1
) -> ShardMeta:
    """Tokenize `spec`'s records into `out_path` (atomically); returns the shard's metadata."""
    t0 = time.perf_counter()
    out_path = Path(out_path)
    encoder = Encoder(tokenizer_dir, threads)
    dtype = token_dtype(encoder.vocab_size)
    sep = spec.separator
    parts: dict[SplitName, _Split] = {s: _Split() for s in SPLITS}
    total = spec.source.text_bytes
    bar = progress(total=total, unit="B", unit_scale=True, desc=f"shard {spec.id}")
    meter = _Meter(spec.id, total, t0)
    log.info(
        "shard %s: %s, about %.1f MB of text, tokenizer %s",
        spec.id,
        spec.source.where(),
        total / 1e6,
        spec.tokenizer,
    )

    def seen(n: int) -> None:
        bar.update(n)
        meter.bytes += n

    with ShardWriter(out_path, dtype) as writer:

        def flush(split: SplitName) -> None:
            part = parts[split]
            if not part.pending:
                return
            encoded = encoder.encode(part.pending)
            n = sum(map(len, encoded))
            ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=n)
            writer.add(split, ids)
            part.tokens += n
            part.last_piece = len(encoded[-1])
            part.pending, part.pending_bytes = [], 0
            meter.tokens += n
            bar.set_postfix_str(meter.rate(), refresh=False)
            meter.maybe_log()

        for split, text in records(spec.source, progress=seen):
            part = parts[split]
            part.records += 1
            part.documents += bool(text.strip())
            nbytes = len(text.encode("utf-8"))
            part.text_bytes += nbytes
            part.pending.append(text + sep)
            part.pending_bytes += nbytes
            part.last = text
            if part.pending_bytes >= BATCH_BYTES or len(part.pending) >= BATCH_RECORDS:
                flush(split)
        for s in SPLITS:
            flush(s)
        last: dict[SplitName, np.ndarray] = {
            s: _bare(encoder, parts[s].last, dtype) for s in SPLITS
        }
        seconds = time.perf_counter() - t0
        tokens = sum(p.tokens for p in parts.values())
        meta = ShardMeta(
            spec=spec,
            vocab_size=encoder.vocab_size,
            dtype=dtype.str,
            splits={
                s: ShardSplit(
                    records=p.records,
                    documents=p.documents,
                    text_bytes=p.text_bytes,
                    tokens=p.tokens,
                    last_piece=p.last_piece,
                    last=len(last[s]),
                )
                for s, p in parts.items()
            },
            seconds=round(seconds, 3),
            tokens_per_s=round(tokens / max(seconds, 1e-9), 1),
            peak_rss_bytes=peak_rss(),
        )
        writer.finish(meta, last)
    bar.close()
    log.info(
        "shard %s: wrote %s: %s tokens (%s) in %.1f s, %s tokens a second, peak memory %.0f MB",
        spec.id,
        out_path,
        f"{tokens:,}",
        ", ".join(f"{s} {parts[s].tokens:,}" for s in SPLITS if parts[s].records),
        meta.seconds,
        f"{meta.tokens_per_s:,.0f}",
        meta.peak_rss_bytes / 1e6,
    )
    return meta


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource
    import sys

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024  # bytes on macOS, KiB on Linux


def _bare(encoder: Encoder, text: str | None, dtype: np.dtype) -> np.ndarray:
    """The ids of a split's last record alone (no separator after it)."""
    if text is None:
        return np.zeros(0, dtype=dtype)
    return np.asarray(encoder.encode([text])[0], dtype=dtype)


class _Meter:
    """Bytes and tokens so far, the rate and the time left, as a log line now and then."""

    def __init__(self, shard: str, total: int, t0: float) -> None:
        self.shard, self.total, self.t0 = shard, total, t0
        self.bytes = 0
        self.tokens = 0
        self._logged = t0

    def rate(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return f"{self.tokens / dt / 1e6:.2f}M tokens a second"

    def maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._logged < LOG_EVERY_S:
            return
        self._logged = now
        dt = now - self.t0
        done = self.bytes / max(self.total, 1)
        left = dt * (1 - done) / done if done > 0 else float("nan")
        log.info(
            "shard %s: %.0f%% (%.1f of %.1f MB), %s tokens, %s, about %.0f s left",
            self.shard,
            100 * done,
            self.bytes / 1e6,
            self.total / 1e6,
            f"{self.tokens:,}",
            self.rate(),
            left,
        )

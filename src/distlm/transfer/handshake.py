"""The control protocol around the bytes: agree on the plan before, agree on the result after.

Before: the plan travels down the chain; every receiver checks it against its template and reports
to the source, which tells everyone to go or to stop, so a mismatch stops all ranks with one error.
After: every receiver reports its figures to the source, which tells everyone whether all verified.
The messages are the typed, versioned ones of distlm.transfer.messages.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from distlm.transfer.documents import ReceiverStats, TransferStats
from distlm.transfer.errors import TransferError
from distlm.transfer.messages import (
    MetadataCheck,
    MetadataVerdict,
    PlanMessage,
    TransferVerdict,
    read_message,
)
from distlm.transfer.plan import Plan, check_template, dtype_of
from distlm.transfer.session import TransferSession

Tensors = dict[str, torch.Tensor]


def exchange_metadata(
    s: TransferSession, plan: Plan | None, tensors: Mapping[str, torch.Tensor] | None
) -> tuple[Plan, Tensors, Tensors]:
    """Agree on the source's `plan` (None elsewhere). Returns the plan, the tensors by name (the
    source's own; a receiver's template or new tensors), and on receivers the contiguous tensor
    each unique entry's bytes land in."""
    link = s.link
    if s.is_src:
        assert plan is not None and tensors is not None  # TransferSession.open checked
        if s.receivers:
            link.send_message(PlanMessage.of(plan), s.receivers[0], "metadata")
        by_rank: dict[int, list[str]] = {}
        for r in s.receivers:
            status = link.recv_message(r, MetadataCheck, "metadata check")
            if status.problems:
                by_rank[r] = status.problems
        for r in s.receivers:
            link.send_message(MetadataVerdict(problems=by_rank), r, "metadata verdict")
        _raise_problems(by_rank, "metadata")
        return plan, dict(tensors), {}
    prev, nxt = s.prev, s.nxt
    assert prev is not None
    blob = link.recv_bytes(prev, "metadata")
    if nxt is not None:
        link.send_bytes(blob, nxt, "metadata")  # relayed as it came: each receiver reads it
    problems: list[str] = []
    try:
        plan = read_message(blob, PlanMessage, s.src).to_plan()
        if tensors is not None:
            problems = check_template(plan, tensors, f"rank {s.rank}")
    except (TransferError, ValueError, KeyError, TypeError) as e:
        problems = [f"rank {s.rank}: unreadable metadata from rank {s.src}: {e}"]
    link.send_message(MetadataCheck(problems=problems), s.src, "metadata check")
    verdict = link.recv_message(s.src, MetadataVerdict, "metadata verdict")
    _raise_problems(verdict.problems, "metadata")
    assert plan is not None  # no problems reported: the plan was read
    dest, staged = _destination(plan, tensors, s.device)
    return plan, dest, staged


def _raise_problems(problems: dict[int, list[str]], what: str) -> None:
    if problems:
        lines = [p for r in sorted(problems) for p in problems[r]]
        raise TransferError(
            f"{what} check failed on rank {', '.join(map(str, sorted(problems)))}:\n  "
            + "\n  ".join(lines)
        )


def _destination(
    plan: Plan, template: Mapping[str, torch.Tensor] | None, device: torch.device
) -> tuple[Tensors, Tensors]:
    """Receiver tensors by name, and for each unique entry the contiguous tensor bytes land in."""
    dest: Tensors = {}
    staged: Tensors = {}
    for e in plan.entries:
        if e.alias is not None:
            continue
        if template is None:
            t = torch.empty(e.shape, dtype=dtype_of(e.dtype), device=device)
            dest[e.name] = t
            staged[e.name] = t
        else:
            t = template[e.name]
            dest[e.name] = t
            staged[e.name] = (
                t if t.is_contiguous() else torch.empty(e.shape, dtype=t.dtype, device=t.device)
            )
    for e in plan.entries:
        if e.alias is not None:
            dest[e.name] = dest[e.alias] if template is None else template[e.name]
    return dest, staged


def finish(s: TransferSession, stats: TransferStats, t1: float) -> TransferStats:
    """Receivers report to the source; it tells all whether everyone verified. Raises if not."""
    link = s.link
    if not s.is_src:
        link.send_message(stats, s.src, "transfer report")
        verdict = link.recv_message(s.src, TransferVerdict, "transfer verdict")
        if not verdict.ok:
            raise TransferError(verdict.error)
        return stats.model_copy(update={"all_verified": True})
    receivers = [link.recv_message(r, TransferStats, "transfer report") for r in s.receivers]
    # The sender's clock stops when the last receiver has reported: that is the broadcast time.
    seconds = time.perf_counter() - t1
    bad = [r for r in receivers if not r.verified]
    error = ""
    if bad:
        error = "corrupted data: " + "; ".join(
            f"rank {r.rank}: {m}" for r in bad for m in r.mismatches[:3]
        )
    for r in s.receivers:
        link.send_message(TransferVerdict(ok=not bad, error=error), r, "transfer verdict")
    if bad:
        raise TransferError(error)
    return stats.model_copy(
        update={
            "seconds": round(seconds, 6),
            "gbps": round(stats.bytes / seconds / 1e9, 4) if seconds > 0 else None,
            "receivers": [
                ReceiverStats(
                    rank=r.rank,
                    seconds=r.seconds,
                    gbps=r.gbps,
                    verified=bool(r.verified),
                    checksum_seconds=r.checksum_seconds,
                    unpack_seconds=r.unpack_seconds,
                    mismatches=r.mismatches,
                )
                for r in receivers
            ],
            "verified": True,
            "all_verified": True,
        }
    )

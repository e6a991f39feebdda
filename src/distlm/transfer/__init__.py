"""Send a state dict from one rank to every other rank: bucketed, pipelined, verified.

    from distlm.transfer import broadcast_state_dict
    # settings: distlm.settings.TransferSettings (transport, bucket_mb, chunk_mb, timeout_s)
    result = broadcast_state_dict(sd if topo.is_main else template_or_None, settings=settings)
    result.tensors   # the received (or sent) dict; a template is filled in place
    result.stats     # JSON-able figures: bytes, buckets, seconds, GB/s, verified, transport, ...

How it moves the bytes (what NCCL's ring broadcast and RL weight-sync engines do):
- Metadata first: names, shapes, dtypes and byte offsets of every tensor in one virtual byte
  stream (tied tensors travel once). Every receiver checks it against its template and reports to
  the source, which tells everyone to go or to stop, so a mismatch stops all ranks with one error.
- The stream is cut into buckets (`bucket_mb`); a bucket is packed into one of two flat buffers
  while the other is on the wire (double buffering), and may split a tensor.
- Ranks form a chain src -> r1 -> r2 -> ... Each bucket travels in chunks (`chunk_mb`); a receiver
  forwards chunk c to its successor as soon as it has it, while chunk c+1 is arriving. Every link
  carries the model once, so N receivers take about as long as one.
- Each chunk carries a 128-bit linear checksum (sum and position-weighted sum of its 64-bit words,
  mod 2^64, computed with torch on the buffer's device); receivers compute it while later chunks
  are in flight and compare it with the sender's before the weights are used. A mismatch names the
  bucket, the byte range and the tensors in it.
- Every wait has a timeout (`timeout_s`); ranks beat a heartbeat into the torch.distributed store,
  so when a peer dies or hangs the error names the rank that stopped, not just the neighbour.

Beyond one job's world: `Peers.own` makes a group of its own on a store both sides reach, which
is how the training ranks push weights into a running server (push.py; distlm.train.pushes).

Transports: "torch" (torch.distributed point-to-point: NCCL for GPU tensors, gloo for CPU) and
"uccl" (UCCL's P2P engine for the bulk data, torch.distributed for the small control messages;
see distlm.transfer.uccl). A transport that cannot run raises TransferError saying why.

Where things are:
    chain.py      broadcast_state_dict: the steps below in order along the chain, and the figures it returns
    session.py    TransferSession: one transfer's state (ranks, chain, device, link, plan, buffers)
    peers.py      who takes part: the torch.distributed world, or a group of its own on a store
    push.py       a push into a running pipeline's stages, each its own part (PushSender, receive)
    plan.py       the bucket plan: tensors in the byte stream, buckets, chunks, zero-copy messages
    handshake.py  the plan agreed before the bytes, the verdict after them
    messages.py   the typed, versioned messages of the handshake
    stream.py     the bucket stream: pack and send, receive, forward, check, unpack
    checksum.py   the per-chunk checksum
    link.py       control messages over torch.distributed, every wait bounded
    watch.py      heartbeats; names the rank that stopped
    planes.py     data planes: the "torch" transport, and how one is chosen
    uccl.py       the "uccl" data plane, and why it cannot run where it cannot
    errors.py     TransferError
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distlm.core.lazy import lazy_names

if TYPE_CHECKING:
    from distlm.transfer.chain import TransferResult, broadcast_state_dict
    from distlm.transfer.checksum import Checksum
    from distlm.transfer.errors import TransferError
    from distlm.transfer.messages import PlanMessage
    from distlm.transfer.plan import ALIGN, Plan, check_template, make_plan
    from distlm.transfer.session import TransferSession
    from distlm.transfer.uccl import check_uccl, uccl_problems

# Imported when first asked for (PEP 562), so that a light module of this package (its documents)
# can be imported without the rest: the report and distlm-launch read documents, and must not
# import torch for them.
_WHERE = {
    "ALIGN": "distlm.transfer.plan",
    "Checksum": "distlm.transfer.checksum",
    "Plan": "distlm.transfer.plan",
    "PlanMessage": "distlm.transfer.messages",
    "TransferError": "distlm.transfer.errors",
    "TransferResult": "distlm.transfer.chain",
    "TransferSession": "distlm.transfer.session",
    "broadcast_state_dict": "distlm.transfer.chain",
    "check_template": "distlm.transfer.plan",
    "check_uccl": "distlm.transfer.uccl",
    "make_plan": "distlm.transfer.plan",
    "uccl_problems": "distlm.transfer.uccl",
}


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = [
    "ALIGN",
    "Checksum",
    "Plan",
    "PlanMessage",
    "TransferError",
    "TransferResult",
    "TransferSession",
    "broadcast_state_dict",
    "check_template",
    "check_uccl",
    "make_plan",
    "uccl_problems",
]

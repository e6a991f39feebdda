"""A micro-batch of a pipeline stage: its items (`Item`: one sequence's new tokens) and where
its tokens go (`_Plan`: cache rows and positions; `_Decode`: the decode items attended together
in one SDPA call, over their lanes' cached keys with a mask of each lane's length). The stage
(engine/pipeline_stage.py) runs the plan; the static decode steps (engine/graphs.py) run the
same attention over fixed rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Item:
    """One sequence's slice of a micro-batch: `n` new tokens at positions [pos, pos + n)."""

    seq: int  # sequence id (unique per run)
    lane: int  # KV-cache slot
    pos: int  # position of the first new token; 0 starts the lane afresh (prefill)
    n: int

    @property
    def decode(self) -> bool:
        """One new token after cached ones: what the decode steps batch (eager or as a graph)."""
        return self.n == 1 and self.pos > 0


def _attend_decode(
    d: _Decode, qd: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    """The decode rows' queries qd (R, n_head, 1, D) over their cache rows -> (R, n_head, 1, D)."""
    if d.lanes is None:  # the cache rows [lo, lo + R) in place: a view, nothing copied
        Kd, Vd = K[d.lo : d.lo + d.R, :, : d.T], V[d.lo : d.lo + d.R, :, : d.T]
    else:  # lanes spread out: their rows gathered
        Kd, Vd = K[d.lanes, :, : d.T], V[d.lanes, :, : d.T]
    return F.scaled_dot_product_attention(qd, Kd, Vd, attn_mask=d.mask, scale=scale, enable_gqa=gqa)


class _Plan:
    """Where a micro-batch's tokens go: cache rows, and the decode items attended together."""

    def __init__(self, items: list[Item], dev, dtype: torch.dtype = torch.float32) -> None:
        self.single = items[0] if len(items) == 1 else None
        if self.single is not None:
            it = self.single  # each new token's position (N,), for embeddings and rotary
            self.positions = torch.arange(it.pos, it.pos + it.n, device=dev)
            return
        lanes: list[int] = []
        positions: list[int] = []
        decode: list[tuple[int, Item]] = []
        self.others: list[tuple[int, Item]] = []
        off = 0
        for it in items:
            if it.decode:
                decode.append((off, it))
                lanes.append(it.lane)
                positions.append(it.pos)
            else:
                self.others.append((off, it))
                lanes += [it.lane] * it.n
                positions += range(it.pos, it.pos + it.n)
            off += it.n
        # one tensor made for both (each torch.tensor call costs microseconds a step)
        self.lanes, self.positions = torch.tensor([lanes, positions], device=dev).unbind(0)
        self.decode = _Decode(decode, dev, dtype, whole=not self.others) if decode else None


class _Decode:
    """The decode items of a micro-batch (one new token each), attended together in one SDPA
    call: a batch of R rows over T cached positions, each row masked to its lane's length.

    When the items' lanes lie close together (the scheduler hands out the lowest lanes first and
    reuses freed ones, so they do while one stage serves), the rows are the cache's own rows
    lo..lo + R - 1, read in place; a row whose lane has no item here attends position 0 with
    another item's query, its output unused. Else the rows are the items' lanes, gathered (a
    copy of their keys and values per layer).

    The mask is additive (0 where a row attends, -inf elsewhere), made once for every layer of
    the step: SDPA turns a boolean mask into exactly this one in each call."""

    def __init__(self, decode: list[tuple[int, Item]], dev, dtype, *, whole: bool) -> None:
        self.B = B = len(decode)
        lanes = [it.lane for _, it in decode]
        rows = [o for o, _ in decode]  # the items' tokens in the micro-batch
        self.T = max(it.pos for _, it in decode) + 1
        self.lo = min(lanes)
        self.R = max(lanes) - self.lo + 1
        self.lanes: torch.Tensor | None = None  # None: the rows lo..lo + R - 1, in place
        if self.R > 2 * B:  # too sparse: attending every row between them would cost more
            self.R, self.lanes = B, torch.tensor(lanes, device=dev)
            at = list(range(B))
        else:
            at = [lane - self.lo for lane in lanes]
        # `first`: the items are the micro-batch's first B tokens (the scheduler launches decodes
        # first, by lane); `aligned`: and on lanes lo, lo + 1, ... in order, so item i is token
        # i and row i, its query and output taken as they lie; `whole`: and nothing else is in it
        self.first = rows == list(range(B))
        self.aligned = self.first and self.lanes is None and self.R == B and at == list(range(B))
        self.whole = whole and self.aligned
        ends = [1] * self.R  # a row with no item here attends position 0 (output unused)
        src = [rows[0]] * self.R  # each row's query: its item's token (any, for a row without)
        for row, o, (_, it) in zip(at, rows, decode):
            ends[row] = it.pos + 1
            src[row] = o
        if not self.aligned:
            self.src = torch.tensor(src, device=dev)  # (R,)
            self.at = torch.tensor(at, device=dev)  # (B,) each item's row
        if not self.first:
            self.rows = torch.tensor(rows, device=dev)  # (B,)
        beyond = torch.arange(self.T, device=dev) >= torch.tensor(ends, device=dev).unsqueeze(1)
        mask = torch.zeros(self.R, self.T, dtype=dtype, device=dev).masked_fill_(beyond, -torch.inf)
        self.mask = mask[:, None, None, :]  # (R, 1, 1, T): each row's length

"""The per-message checksum every receiver compares with the sender's before the weights are used."""

from __future__ import annotations

import torch


class Checksum:
    """128-bit linear checksum of a message, mod 2^64, computed in one pass on its device.

    The message's 64-bit words are cut into rows of ROW words (1 KiB); with s_r the sum of row r,
    d0 = sum_r a_r s_r and d1 = sum_r b_r s_r, with random odd weights a, b. Any changed word,
    dropped, duplicated, zeroed or misplaced row changes both (odd weights are invertible mod 2^64);
    what it cannot see is a change that keeps every row's sum (two words of one row swapped). That is
    the price of one streaming reduction at memory speed, next to the transfer it guards: an
    integrity check of the transport, not a cryptographic digest.
    """

    ROW = 128  # words per row

    def __init__(self, max_bytes: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0x5EED)
        rows = max_bytes // (8 * self.ROW) + 2
        w = torch.randint(-(2**62), 2**62, (2, rows), dtype=torch.int64, generator=g) | 1
        self.weights = w.to(device)

    def __call__(self, data: torch.Tensor, out: torch.Tensor) -> None:
        if data.storage_offset() % 8:  # rare: a view into a tensor at an odd offset
            data = data.clone()
        n8 = data.numel() // 8 * 8
        words = data[:n8].view(torch.int64)
        full = words.numel() // self.ROW
        sums = words[: full * self.ROW].view(full, self.ROW).sum(1)  # (rows,)
        tail = words[full * self.ROW :].sum().reshape(1)  # < ROW words: one more row
        if n8 < data.numel():  # the last < 8 bytes, as one zero-padded word in that row
            last = torch.zeros(8, dtype=torch.uint8, device=data.device)
            last[: data.numel() - n8] = data[n8:]
            tail = tail + last.view(torch.int64)
        sums = torch.cat([sums, tail])
        out.copy_((self.weights[:, : sums.numel()] * sums).sum(1))

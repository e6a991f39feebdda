"""Examples packed into the rows of a batch (distlm's model runs them as TRL's padding-free
packing and torchtitan's document masking do): each position knows its example, an example's
positions restart at 0, and attention never crosses examples (a block-diagonal causal mask).

    packing = Packing(example)            # (B, T) int64: each position's example along its row
    logits = model(ids, packing=packing)  # each example's logits as if it ran alone, unpadded

`example` numbers the examples of a row in order (non-decreasing along the row); -1 marks
padding, which attends to the padding before it alone (its positions are never targets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where each example of a packed batch lies: `example` (B, T), int64."""

    example: torch.Tensor

    @classmethod
    def of_lengths(
        cls, rows: list[list[int]], length: int, device: torch.device | str = "cpu"
    ) -> Packing:
        """The packing of rows of examples of these lengths, each row padded to `length`."""
        example = torch.full((len(rows), length), -1, dtype=torch.int64)
        for r, lengths in enumerate(rows):
            if sum(lengths) > length:
                raise ValueError(f"row {r}: examples of {sum(lengths)} tokens in {length}")
            at = 0
            for i, n in enumerate(lengths):
                example[r, at : at + n] = i
                at += n
        return cls(example.to(device))

    def positions(self) -> torch.Tensor:
        """Each position's place in its example (B, T): 0 where an example starts."""
        t = self.example.shape[1]
        index = torch.arange(t, device=self.example.device).expand_as(self.example)
        start = torch.ones_like(self.example, dtype=torch.bool)
        start[:, 1:] = self.example[:, 1:] != self.example[:, :-1]
        first = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
        return index - first

    def mask(self) -> torch.Tensor:
        """SDPA's boolean mask (B, 1, T, T): query i sees key j when j <= i in the same example."""
        t = self.example.shape[1]
        same = self.example[:, :, None] == self.example[:, None, :]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.example.device).tril()
        return (same & causal)[:, None]

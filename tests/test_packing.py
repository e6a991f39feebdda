"""Packed batches (distlm.family.packing) on every model shape distlm supports: a row of examples
packed end to end gives each example the logits, loss and gradients it has run alone, unpadded
(float32, within 1e-5), and no example's tokens move another's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness.family_shapes import SHAPES, ids, models

from distlm.family.packing import Packing

# two rows of examples of unequal lengths, each row padded to 26 positions (2 and 1 of padding)
ROWS = [[7, 13, 4], [20, 5]]
LENGTH = 26


def spans():
    """(row, start, stop) of each example."""
    for r, lengths in enumerate(ROWS):
        at = 0
        for n in lengths:
            yield r, at, at + n
            at += n


def test_positions_restart_and_attention_stays_within_an_example():
    p = Packing.of_lengths([[3, 2], [4]], 6)
    assert p.example.tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    assert p.positions().tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    m = p.mask()[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    with pytest.raises(ValueError, match="row 0: examples of 7 tokens in 6"):
        Packing.of_lengths([[4, 3]], 6)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_packed_row_gives_each_example_its_own_logits(shape):
    _, model = models(shape)
    model.eval()
    x = ids(batch=len(ROWS), length=LENGTH)
    with torch.no_grad():
        packed = model(x, packing=Packing.of_lengths(ROWS, LENGTH))
        for r, a, b in spans():
            alone = model(x[r : r + 1, a:b])[0]
            torch.testing.assert_close(packed[r, a:b], alone, rtol=1e-5, atol=1e-5)


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


@pytest.mark.parametrize("shape", SHAPES)
def test_a_packed_rows_loss_and_gradients_are_its_examples_run_alone(shape):
    """The loss: the sum over every example's next tokens (none across examples, none from
    padding), over their count; run alone, each example's sum over the same count."""
    _, packed_model = models(shape)
    _, alone_model = models(shape)
    x = ids(batch=len(ROWS), length=LENGTH, seed=5)
    n_targets = sum(b - a - 1 for _, a, b in spans())

    logits = packed_model(x, packing=Packing.of_lengths(ROWS, LENGTH))
    sums = [_loss_sum(logits[r, a : b - 1], x[r, a + 1 : b]) for r, a, b in spans()]
    packed = torch.stack(sums).sum() / n_targets
    packed.backward()

    alone = torch.zeros(())
    for r, a, b in spans():
        part = _loss_sum(alone_model(x[r : r + 1, a:b])[0, :-1], x[r, a + 1 : b]) / n_targets
        part.backward()
        alone = alone + part.detach()

    assert packed.item() == pytest.approx(alone.item(), rel=1e-5, abs=1e-5)
    theirs = dict(alone_model.named_parameters())
    for name, p in packed_model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("shape", SHAPES)
def test_an_examples_tokens_move_no_other_examples_logits(shape):
    _, model = models(shape)
    model.eval()
    x = ids(batch=len(ROWS), length=LENGTH, seed=7)
    y = x.clone()
    y[0, 0:7] = (x[0, 0:7] + 1) % int(x.max() + 1)  # row 0's first example, changed
    packing = Packing.of_lengths(ROWS, LENGTH)
    with torch.no_grad():
        before, after = model(x, packing=packing), model(y, packing=packing)
    assert not torch.equal(before[0, :7], after[0, :7])
    assert torch.equal(before[0, 7:], after[0, 7:])  # the other examples and the padding
    assert torch.equal(before[1], after[1])

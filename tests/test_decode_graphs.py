"""The pipeline engine's decode steps as static steps, one per block of cache rows
(distlm.inference.engine.graphs' `DecodeGraphs`: CUDA graphs on a GPU, tests/test_gpu.py),
run here on the CPU without a capture: the same logits as the eager step at every step of a
schedule in which sequences start, decode beside each other, end and leave gaps, the cache
grows, and a step attends the positions its rows hold (rounded up), for GPT-2 and the Llama
family (one and two grouped KV heads, Qwen3's head width), at one and three stages."""

from __future__ import annotations

import pytest
import torch

from distlm.inference.engine.graphs import MIN_SPAN
from distlm.inference.engine.pipeline_stage import Item, load_stage
from distlm.runtime.device import DeviceBackend

CPU = torch.device("cpu")
STATIC = DeviceBackend(CPU, decode_graphs=True)  # the GPU's decode steps, on the CPU


class Chain:
    """The S stage models of a pipeline folder in one process, one after the other."""

    def __init__(self, folder, stages: int, hw: DeviceBackend) -> None:
        self.models = [load_stage(folder, s, world=stages, hw=hw) for s in range(stages)]

    def __call__(self, items: list[Item], x: torch.Tensor) -> torch.Tensor:
        for m in self.models:
            x = m(items, x)
        return x

    def release(self, lane: int) -> None:
        for m in self.models:
            m.release(lane)

    def blocks(self) -> list[list[tuple[int, int]]]:
        return [m.graphs.blocks() if m.graphs else [] for m in self.models]

    def steps(self) -> list[list[tuple[int, int, int]]]:
        return [m.graphs.steps() if m.graphs else [] for m in self.models]


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("case", ["gpt2", "llama-kv1-tied", "qwen3-kv2-untied-hd16"])
def test_static_decode_steps_compute_what_the_eager_steps_do(pipeline_folders, case, stages):
    folder = pipeline_folders(case)[stages]
    eager = Chain(folder, stages, DeviceBackend.cpu())
    assert all(m.graphs is None for m in eager.models)
    same_steps(eager, Chain(folder, stages, STATIC), tol=1e-5)


def same_steps(eager: Chain, static: Chain, *, tol: float) -> None:
    """A schedule of micro-batches through both chains: at every step the same logits (to
    `tol`) and the same greedy tokens; the static steps' blocks of rows as the cache's lanes make them
    (tests/test_gpu.py runs it on a GPU, where they are CUDA graphs)."""
    stages = len(static.models)
    g = torch.Generator().manual_seed(0)
    vocab = eager.models[-1].blocks.lm_head.weight.shape[0]
    length: dict[int, int] = {}  # lane -> positions cached
    last: dict[int, int] = {}  # lane -> its newest token
    used: set[tuple[int, int]] = set()  # the blocks of rows (lo, R) the static steps ran

    def step(prefill: dict[int, int], decode: list[int]) -> None:
        """One micro-batch through both chains: prompts of the given lengths on their lanes
        (new sequences), then one new token on each lane of `decode`."""
        items, ids = [], []
        for lane in decode:  # the scheduler launches decodes first
            items.append(Item(lane, lane, length[lane], 1))
            ids.append(last[lane])
        for lane, n in prefill.items():
            items.append(Item(lane, lane, 0, n))
            ids += torch.randint(0, vocab, (n,), generator=g).tolist()
        x = torch.tensor(ids)
        want, got = eager(items, x), static(items, x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for it, tok in zip(items, want.argmax(-1).tolist(), strict=True):
            length[it.lane] = it.pos + it.n
            last[it.lane] = tok
        used.update(b for m in static.blocks() for b in m)

    def end(lane: int) -> None:
        eager.release(lane)
        static.release(lane)
        del length[lane], last[lane]

    step({0: 5, 1: 3, 2: 9}, [])  # three prompts in one prefill (eager): a cache of 3 lanes
    for _ in range(3):
        step({}, [0, 1, 2])  # rows 0-2 (4 rounded up, at most the cache's lanes)
    assert static.blocks() == [[(0, 3)]] * stages
    step({3: 4}, [])  # a prompt alone: the cache grows to 6 lanes, the steps are dropped
    assert static.blocks() == [[]] * stages
    step({}, [0, 1, 2, 3])  # rows 0-3
    # micro-batches of their own (a pipeline's): a live lane without an item in the step keeps
    # its cache (its row's key and value go to the scratch position)
    step({}, [0, 2, 3])
    step({}, [1])  # row 1 alone
    step({}, [2, 3])  # rows 2-3
    step({}, [0, 1, 2, 3])
    end(1)
    for _ in range(2):
        step({}, [0, 2, 3])  # a gap: lane 1 ended
    step({1: 6}, [0, 2, 3])  # a prompt beside decodes: the eager step
    step({4: 2}, [0, 1, 2, 3])
    for _ in range(3):
        step({}, [0, 1, 2, 3, 4])  # rows 0-5 (8 rounded up, at most the cache's 6 lanes)
    step({}, [4])  # one item on a high lane: row 4 alone
    assert used == {(0, 3), (0, 4), (1, 1), (2, 2), (0, 6), (4, 1)}, used
    # the steps attend the positions their rows hold, rounded up (at least MIN_SPAN), not the
    # cache's: every row so far holds fewer than MIN_SPAN
    assert static.steps()[0] and all(T == MIN_SPAN for m in static.steps() for _, _, T in m)
    long = MIN_SPAN + 8
    assert static.models[0].context >= 2 * MIN_SPAN
    step({5: long}, [])  # a long prompt (eager) in the block's last lane
    step({}, [0, 1, 2, 3, 4])  # rows 0-5 over MIN_SPAN positions, lane 5's beyond them
    step({}, [0, 1, 2, 3, 4, 5])  # the longest item's long + 1, rounded up
    assert static.models[0].kv[0].shape[3] - 1 >= 2 * MIN_SPAN
    assert {(0, 6, MIN_SPAN), (0, 6, 2 * MIN_SPAN)} <= set(static.steps()[0])
    for lane in list(length):
        end(lane)  # an idle stage: the eager one frees its cache, the static one keeps it
    assert eager.models[0].cached_bytes() == 0 < static.models[0].cached_bytes()
    step({2: 3}, [])  # the next sequence starts afresh
    step({}, [2])
    assert (2, 1) in static.blocks()[0]

"""Where a live update's weights come from (what `Prepare` carries round the ring, and each
stage reads its part from): `FromDisk` (a folder's files) or `FromPush` (a sender's offer: the
training ranks'). distlm.inference.engine.update runs the update."""

from __future__ import annotations

from dataclasses import dataclass

from distlm.model.weights import WeightFiles, read_tensors
from distlm.transfer.documents import PushOffer, PushWant


class Source:
    """Where an update's weights come from (what `Prepare` carries round the ring): `label` and
    `kind` name it, `digest` names the weights; each stage asks `host_bytes` (the host memory its
    part takes as it arrives) and `read`s its part (transformers' names)."""

    @property
    def label(self) -> str:
        raise NotImplementedError

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def digest(self) -> str:
        raise NotImplementedError

    def host_bytes(self, mine: dict, tied: dict[str, str]) -> int:
        raise NotImplementedError

    def read(self, mine: dict, tied: dict[str, str], *, stage: int, stages: int) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class FromDisk(Source):
    """A folder's files (distlm.model.weights): each stage reads its tensors, every file it reads
    hashed through the open file first."""

    files: WeightFiles

    @property
    def label(self) -> str:
        return self.files.folder

    @property
    def kind(self) -> str:
        return self.files.kind

    @property
    def digest(self) -> str:
        return self.files.digest

    def host_bytes(self, mine: dict, tied: dict[str, str]) -> int:
        return sum(h.end - h.start for _, h in self.files.held(list(mine), tied).values())

    def read(self, mine: dict, tied: dict[str, str], *, stage: int, stages: int) -> dict:
        return read_tensors(self.files, list(mine), tied)


@dataclass(frozen=True)
class FromPush(Source):
    """A sender's offer (distlm.transfer.push: the training ranks'): each stage asks it for exactly
    its tensors (names, shapes, dtypes) and receives them over a group of its own."""

    offer: PushOffer

    @property
    def label(self) -> str:
        return self.offer.where

    @property
    def kind(self) -> str:
        return "training push"

    @property
    def digest(self) -> str:
        return self.offer.digest

    def host_bytes(self, mine: dict, tied: dict[str, str]) -> int:
        return sum(t.numel() * t.element_size() for t in mine.values())

    def read(self, mine: dict, tied: dict[str, str], *, stage: int, stages: int) -> dict:
        from distlm.transfer.push import receive

        want = PushWant.of(mine, stage=stage, stages=stages, tied=tied)
        return receive(self.offer, want).tensors

"""Where a live update's weights come from (what `Prepare` carries round the ring, and each
stage reads its part from): `FromDisk` (a folder's files) or `FromPush` (a sender's offer: the
training ranks'). distlm.inference.engine.update runs the update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlm.model.weights import WeightFiles, read_tensors
from distlm.runtime.device import is_gpu
from distlm.transfer.documents import PushDevice, PushOffer, PushWant


class Source:
    """Where an update's weights come from (what `Prepare` carries round the ring): `label` and
    `kind` name it, `digest` names the weights; each stage asks `landing_bytes` (the memory of
    its device its part takes as it arrives, beside the staged copy) and `read`s its part
    (transformers' names)."""

    @property
    def label(self) -> str:
        raise NotImplementedError

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def digest(self) -> str:
        raise NotImplementedError

    def landing_bytes(self, mine: dict, tied: dict[str, str], device: torch.device) -> int:
        raise NotImplementedError

    def read(
        self, mine: dict, tied: dict[str, str], *, stage: int, stages: int, device: torch.device
    ) -> dict:
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

    def landing_bytes(self, mine: dict, tied: dict[str, str], device: torch.device) -> int:
        if is_gpu(device):  # read into host memory
            return 0
        return sum(h.end - h.start for _, h in self.files.held(list(mine), tied).values())

    def read(
        self, mine: dict, tied: dict[str, str], *, stage: int, stages: int, device: torch.device
    ) -> dict:
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

    def landing_bytes(self, mine: dict, tied: dict[str, str], device: torch.device) -> int:
        from distlm.transfer.push import route_for

        offer = self.offer
        route = route_for(offer.device, PushDevice.of(device), offer.transport, offer.where)
        if is_gpu(device) and not route.on_gpu:
            return 0  # received into host memory
        return sum(t.numel() * t.element_size() for t in mine.values())

    def read(
        self, mine: dict, tied: dict[str, str], *, stage: int, stages: int, device: torch.device
    ) -> dict:
        from distlm.transfer.push import receive

        want = PushWant.of(mine, stage=stage, stages=stages, tied=tied, device=device)
        return receive(self.offer, want, device).tensors

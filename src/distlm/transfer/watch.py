"""Liveness: heartbeats in the torch.distributed store, and on a failed wait the rank that stopped."""

from __future__ import annotations

import re
import threading
import time
from typing import NoReturn

from torch.distributed.distributed_c10d import Store

from distlm.transfer.errors import TransferError

_HEARTBEAT_S = 1.0


class Watch:
    """Heartbeats in the torch.distributed store; on a failed wait, finds the rank that stopped."""

    def __init__(
        self, store: Store | None, prefix: str, rank: int, ranks: list[int], timeout_s: float
    ) -> None:
        self.prefix, self.rank, self.ranks = prefix, rank, ranks
        self.reported = False
        self.store = store  # None: no heartbeats, a failure names only the peer
        self._stop = threading.Event()
        self._thread = None
        self.probe_s = max(2.5 * _HEARTBEAT_S, min(5.0, timeout_s / 4))
        if self.store is not None:
            self._thread = threading.Thread(
                target=self._beat, name="distlm-transfer-heartbeat", daemon=True
            )
            self._thread.start()

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _beat(self) -> None:
        store = self.store
        assert store is not None  # started only with a store
        while not self._stop.is_set():
            try:
                store.add(self._key("hb", self.rank), 1)
            except Exception:  # the store is gone: the failure shows up in the data path
                return
            self._stop.wait(_HEARTBEAT_S)

    def close(self, *, done: bool = True) -> None:
        self._stop.set()
        if self.store is not None and done:
            try:
                self.store.set(self._key("done", self.rank), "1")
            except Exception:
                pass

    def _reported(self, store: Store) -> dict[int, str]:
        out = {}
        for r in self.ranks:
            try:
                if store.check([self._key("failed", r)]):
                    out[r] = store.get(self._key("failed", r)).decode()
            except Exception:
                break
        return out

    def diagnose(self) -> str:
        """Which ranks stopped beating, else which reported a failure (a few seconds of probing)."""
        store = self.store
        if store is None:
            return ""
        try:
            before = {r: store.add(self._key("hb", r), 0) for r in self.ranks if r != self.rank}
            time.sleep(self.probe_s)
            after = {r: store.add(self._key("hb", r), 0) for r in before}
            done = {r for r in before if store.check([self._key("done", r)])}
        except Exception as e:
            return f"the torch.distributed store is unreachable ({type(e).__name__}), so rank 0's host may be gone"
        dead = [r for r in before if after[r] == before[r] and r not in done]
        if dead:
            return (
                "rank "
                + ", ".join(map(str, dead))
                + f" stopped (no heartbeat for {self.probe_s:.1f} s)"
            )
        reported = {r: why for r, why in self._reported(store).items() if r != self.rank}
        return "; ".join(f"rank {r} failed: {why}" for r, why in reported.items())

    def fail(self, peer: int, what: str, err: BaseException) -> NoReturn:
        text = _short(err)
        kind = "timed out" if "timeout" in text.lower() or "timed out" in text.lower() else "failed"
        here = f"{what} with rank {peer} {kind} ({type(err).__name__}: {text})"
        cause = self.diagnose()
        self.report(here)  # others see what happened here, not this rank's guess about the cause
        msg = f"rank {self.rank}: {cause}. Here: {here}" if cause else f"rank {self.rank}: {here}"
        raise TransferError(msg) from None

    def report(self, msg: str) -> None:
        self.reported = True
        if self.store is not None:
            try:
                self.store.set(self._key("failed", self.rank), msg[:300])
            except Exception:
                pass
        self.close(done=False)


def _short(err: BaseException) -> str:
    """The gist of a backend error: without gloo's source path and boilerplate advice."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0][:160]

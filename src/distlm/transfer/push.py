"""A push of weights from one process (a training job's rank 0) into a running pipeline's stages,
each stage receiving only its own tensors: the same buckets, chain and checksums as the broadcast,
over a group of its own per stage (distlm.transfer.peers), as vLLM's and SGLang's weight-update
groups are.

    # the sender (distlm.train.pushes): a store the stages can reach, then the offer goes to the server
    sender = PushSender.open(host="node1", settings=transfer_settings, device=trainer_device)
    offer = sender.offer(digest, label, args.signature())  # what the server's route is given
    sender.send(tensors, done=lambda: answered)  # until every stage has its part, or `done`
    del sender                                   # its store stops with it

    # each stage (distlm.inference.engine.update), once its server has taken the offer
    tensors = receive(offer, want, device)       # its own part, checked against `want`

How a stage's part travels (`route_for`, from the offer's device and the stage's, the same on
both sides): GPU to GPU over NCCL when the sender and the stage hold their tensors on two GPUs;
through host memory over gloo when either side is on the host, or when the stage serves on the
sender's own GPU (a trainer and a server sharing a workstation's one GPU: NCCL refuses a group
with two ranks on one GPU). With transfer.transport uccl the bytes go over UCCL's engine GPU to
GPU, the pair group (gloo) carrying the control messages alone; a side on the host is refused
(UCCL moves GPU memory). The route is logged on both sides and is in each stage's figures.

The rendezvous, in the sender's store under `distlm/push/<group>/`:
1. each stage connects and writes `want/<stage>`: a `PushWant` (its tensors' names, shapes and
   dtypes, transformers' names; the tied copies; how many stages there are);
2. the sender reads it and answers `answer/<stage>`: "go", or why it refuses (the stage raises
   that at once); then it sends that stage exactly those tensors, cast to their dtypes (a tied
   copy from its source), over a two-rank group `pair/<stage>` (sender rank 0, stage rank 1) on
   the stage's route, one thread per stage;
3. the stage receives into a template of `want`: the handshake refuses another name, shape or
   dtype (naming the tensor), the chunk checksums refuse corrupted bytes, and the heartbeats name
   the side that stopped. Every wait is bounded by the offer's `timeout_s`;
4. the sender writes `sealed/<stage>`: a keyed BLAKE2b of the part it sent; the stage computes
   the same over what it received and uses the part only when they match.

Who may take part: torch's TCPStore has no authentication, and anyone who reaches its port may
list, read and write its keys. So the store listens on the one address the stages reach (loopback
when the server is on this host), and the offer's `key`, which travels to the server in the
authenticated offer alone, seals both directions: an ask is written as `<HMAC-SHA256 of it>:<it>`,
and the sender sends nothing to an ask not sealed with the key; a part is used only when its
keyed digest is the sender's. A process that reaches the store without the offer can make a push
fail (as anyone on the path of a gloo or NCCL group can), but can neither have the weights sent to
an ask of its own nor have a stage take its tensors for the sender's. The bytes are not encrypted:
like NCCL's and gloo's, the push's data plane belongs on a network you trust.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlm.core.documents import DocumentError, decode, encode
from distlm.core.log import get_logger
from distlm.runtime.device import free_bytes, use_device
from distlm.runtime.device import host as _host
from distlm.settings import TransferSettings
from distlm.transfer.chain import TransferResult, broadcast_state_dict
from distlm.transfer.documents import MAX_ASK_BYTES, PushDevice, PushOffer, PushWant
from distlm.transfer.errors import TransferError
from distlm.transfer.peers import Peers

log = get_logger(__name__)

_POLL_S = 0.2  # how often the sender looks whether the server has given up while it waits
_MEMORY_MARGIN = 256 << 20  # what a part put on the trainer's GPU leaves free there


@dataclass(frozen=True)
class Route:
    """How one stage's part travels: the pair group's `backend` and the data plane
    (`transport`); `on_gpu`: the part is sent from and received into GPU memory (else host
    memory, on both sides)."""

    backend: str  # "nccl" or "gloo"
    transport: str  # "torch" (the group's own send/recv) or "uccl"

    @property
    def on_gpu(self) -> bool:
        return self.backend == "nccl" or self.transport == "uccl"

    def __str__(self) -> str:
        if self.transport == "uccl":
            return "uccl, GPU to GPU"
        return "nccl, GPU to GPU" if self.backend == "nccl" else "gloo, through host memory"


def route_for(sender: PushDevice, stage: PushDevice, transport: str, where: str) -> Route:
    """How a part goes from a sender on `sender` to a stage on `stage` (the module's doc says
    why); TransferError when `transport` cannot carry it (uccl with a side on the host)."""
    if transport == "uccl":
        for side, d in (("the sender", sender), ("the stage", stage)):
            if d.gpu is None:
                raise TransferError(
                    f"{where}: transfer.transport uccl moves GPU memory, and {side} holds its "
                    "tensors in host memory (transfer.transport torch pushes through it)"
                )
        return Route("gloo", "uccl")
    if transport != "torch":
        raise TransferError(f"{where}: unknown transport {transport!r}")
    if sender.gpu is not None and stage.gpu is not None and not sender.same_gpu(stage):
        return Route("nccl", "torch")
    return Route("gloo", "torch")


def store_key(offer_or_group: PushOffer | str, *parts: str) -> str:
    """A key of the push's rendezvous in the sender's store (the module's docstring lists them)."""
    group = offer_or_group if isinstance(offer_or_group, str) else offer_or_group.group
    return "/".join(("distlm/push", group, *parts))


def receive(offer: PushOffer, want: PushWant, device: torch.device | None = None) -> TransferResult:
    """A stage's part of a push, for a stage on `device` (the host when None; `want.device` names
    it): ask for `want` in the sender's store, then receive it over the pair group, on
    `route_for`'s route, in host memory or on `device`; TransferError says what failed (the
    sender gone, another shape, bad bytes)."""
    device = device if device is not None else _host()
    use_device(device)  # a stage receives in its staging thread
    where = f"{offer.where}: stage {want.stage}"
    route = route_for(offer.device, want.device, offer.transport, where)
    timeout = _dt.timedelta(seconds=offer.timeout_s)
    try:
        # a port nothing listens on refuses at once; TCPStore's client would retry it until the
        # timeout, so a sender that is gone is named now, not in timeout_s
        socket.create_connection((offer.host, offer.port), timeout=min(offer.timeout_s, 10)).close()
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            offer.host, offer.port, is_master=False, timeout=timeout, wait_for_workers=False
        )
    except Exception as e:
        raise TransferError(
            f"{offer.where}: the sender's store does not answer ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]})"
        ) from None
    try:
        store.set(store_key(offer, "want", str(want.stage)), seal(offer.key, encode(want)))
        answer = store.get(store_key(offer, "answer", str(want.stage))).decode("utf-8", "replace")
        if answer != "go":
            raise TransferError(f"{offer.where}: stage {want.stage}: the sender {answer}")
        pair = dist.PrefixStore(  # pyright: ignore[reportPrivateImportUsage]
            store_key(offer, "pair", str(want.stage)) + "/", store
        )
        log.info("%s: its part (%.1f MB) comes %s", where, want.nbytes / 1e6, route)
        peers = Peers.own(pair, 1, 2, route.backend, offer.timeout_s)
        try:
            got = broadcast_state_dict(
                want.template(device if route.on_gpu else _host()),
                settings=offer.settings(),
                peers=peers,
            )
        finally:
            peers.close()
        mine = part_digest(offer.key, got.tensors)
        theirs = store.get(store_key(offer, "sealed", str(want.stage))).decode("ascii", "replace")
        if not hmac.compare_digest(mine, theirs):
            raise TransferError(
                f"{offer.where}: stage {want.stage}: the part that arrived is not sealed with the "
                "offer's key (another process answered on the sender's store?); not used"
            )
        return got
    except TransferError:
        raise
    except Exception as e:  # the store or the group: the sender is gone or never came
        raise TransferError(
            f"{offer.where}: stage {want.stage}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None


class PushSender:
    """The sending side of pushes: a store the stages connect to, one offer at a time."""

    def __init__(self, store, host: str, settings: TransferSettings, device: torch.device) -> None:
        self.store, self.host, self.settings, self.device = store, host, settings, device
        self._placing = threading.Lock()  # the stages' threads check the GPU's room one by one

    @classmethod
    def open(
        cls, *, host: str, settings: TransferSettings, device: torch.device | None = None
    ) -> PushSender:
        """A store on a free port of `host`, the address the stages reach this machine by, and
        on no other (torch's TCPStore alone would listen on every interface). `device` is where
        the sender puts a part that travels GPU to GPU (the trainer's GPU; the host when None:
        every part goes through host memory)."""
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(address)
            sock.listen(128)
            port = sock.getsockname()[1]
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=_dt.timedelta(seconds=settings.timeout_s),
                master_listen_fd=sock.fileno(),
                use_libuv=True,
            )
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the socket now, and closes it when it stops
        return cls(store, host, settings, device if device is not None else _host())

    def offer(self, digest: str, label: str, architecture: dict) -> PushOffer:
        """An offer of weights named `digest`, of a model of `architecture` (its
        ModelArgs.signature())."""
        s = self.settings
        return PushOffer(
            host=self.host,
            port=self.store.port,
            group=secrets.token_hex(16),
            key=secrets.token_hex(32),
            digest=digest,
            label=label,
            architecture=architecture,
            bucket_mb=float(s.bucket_mb),
            chunk_mb=float(s.chunk_mb),
            timeout_s=float(s.timeout_s),
            transport=s.transport,
            device=PushDevice.of(self.device),
        )

    def _want(self, offer: PushOffer, stage: int, done: Callable[[], bool]) -> PushWant | None:
        """Stage `stage`'s ask, once written; None when `done` says the server has answered
        (refused, or failed) before it."""
        key = store_key(offer, "want", str(stage))
        waited = 0.0
        while not self.store.check([key]):
            if done():
                return None
            if waited > offer.timeout_s:
                raise TransferError(
                    f"{offer.where}: stage {stage} did not ask for its part within "
                    f"{offer.timeout_s:g} s"
                )
            time.sleep(_POLL_S)
            waited += _POLL_S
        raw = unseal(offer, self.store.get(key), f"stage {stage}'s ask")
        try:
            return decode(raw, PushWant, f"stage {stage}'s ask")
        except DocumentError as e:
            raise TransferError(f"{offer.where}: {e}") from None

    def _answer(self, offer: PushOffer, stage: int, refused: BaseException | None) -> None:
        """Tell stage `stage` whether its part comes ("go") or why not, so that it does not wait
        for a group the sender will never join."""
        word = "go"
        if refused is not None:
            word = "refused: " + str(refused).removeprefix(offer.where).lstrip(": ")[:1000]
        try:
            self.store.set(store_key(offer, "answer", str(stage)), word)
        except Exception:  # the store is ours; a failure here is the refusal's, raised anyway
            pass

    def send(
        self,
        offer: PushOffer,
        tensors: Mapping[str, torch.Tensor],
        done: Callable[[], bool],
        hook: Callable[[int, int, Mapping], None] | None = None,
    ) -> dict[int, TransferResult] | None:
        """Send every stage its part of `tensors` (transformers' names, host memory), each stage
        in a thread of its own; None when the server answered before asking (it refused the
        offer). TransferError names the stage that failed and why. `hook(stage, stages, sent)`
        runs before each stage's part goes (tests: distlm.train.faults)."""
        try:
            first = self._want(offer, 0, done)
        except Exception as e:
            self._answer(offer, 0, e)
            raise
        if first is None:
            return None
        results: dict[int, TransferResult] = {}
        errors: dict[int, BaseException] = {}

        def one(stage: int, want: PushWant | None) -> None:
            use_device(self.device)
            try:
                try:
                    want = want or self._want(offer, stage, done)
                    if want is None:
                        return
                    if want.stage != stage or want.stages != first.stages:
                        raise TransferError(f"{offer.where}: stage {stage} sent a muddled ask")
                    where = f"{offer.where}: stage {stage}"
                    route = route_for(offer.device, want.device, offer.transport, where)
                    with self._placing:
                        part = _part(tensors, want, offer, self._place(route, want, where))
                except Exception as e:
                    self._answer(offer, stage, e)
                    raise
                if hook is not None:
                    hook(stage, first.stages, results)
                self._answer(offer, stage, None)
                pair = dist.PrefixStore(  # pyright: ignore[reportPrivateImportUsage]
                    store_key(offer, "pair", str(stage)) + "/", self.store
                )
                log.info("%s: its part (%.1f MB) goes %s", where, want.nbytes / 1e6, route)
                peers = Peers.own(pair, 0, 2, route.backend, offer.timeout_s)
                try:
                    results[stage] = broadcast_state_dict(
                        part, settings=offer.settings(), peers=peers
                    )
                finally:
                    peers.close()
                # the stage checks what it received against this before it uses it
                self.store.set(store_key(offer, "sealed", str(stage)), part_digest(offer.key, part))
            except BaseException as e:
                errors[stage] = e

        threads = [
            threading.Thread(
                target=one, args=(k, first if k == 0 else None), name=f"push-stage{k}", daemon=True
            )
            for k in range(first.stages)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            stage, e = min(errors.items())
            if isinstance(e, TransferError):
                raise e
            raise TransferError(f"{offer.where}: stage {stage}: {type(e).__name__}: {e}") from e
        return results

    def _place(self, route: Route, want: PushWant, where: str) -> torch.device:
        """Where a stage's part is put to be sent: the sender's GPU on a GPU route (refused
        when that GPU has not the room: a training job's memory is not risked), else the host."""
        if not route.on_gpu:
            return _host()
        free = free_bytes(self.device)
        if want.nbytes + _MEMORY_MARGIN > free:
            raise TransferError(
                f"{where}: its part needs {want.nbytes / 1e6:.0f} MB on the trainer's "
                f"{self.device}, {free / 1e6:.0f} MB are free"
            )
        return self.device


def _part(
    tensors: Mapping[str, torch.Tensor], want: PushWant, offer: PushOffer, device: torch.device
) -> dict[str, torch.Tensor]:
    """A stage's tensors as it asked for them, on `device`: each name (a tied copy from its
    source when the sender has no copy of its own), in its dtype; a name the sender lacks is
    named."""
    out = {}
    for name, spec in want.tensors.items():
        t = tensors.get(name)
        if t is None:
            t = tensors.get(want.tied.get(name, ""))
        if t is None:
            raise TransferError(
                f"{offer.where}: stage {want.stage} needs tensor {name!r}, which the sender lacks"
            )
        if list(t.shape) != spec.shape:
            raise TransferError(
                f"{offer.where}: tensor {name!r} has shape {tuple(t.shape)} here, stage "
                f"{want.stage} serves {tuple(spec.shape)} (another architecture?)"
            )
        out[name] = t.detach().to(device=device, dtype=getattr(torch, spec.dtype)).contiguous()
    return out


def part_digest(key: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """A keyed BLAKE2b of a stage's part: every tensor's name, dtype, shape and bytes, in name
    order (hashlib leaves the GIL for the bytes: the stages' threads run side by side)."""
    h = hashlib.blake2b(key=bytes.fromhex(key), digest_size=32)
    for name in sorted(tensors):
        t = tensors[name].detach().to(_host()).contiguous()  # a GPU route's part: read back
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # an ndarray is a buffer (typeshed for 3.11 does not say so)
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]
    return h.hexdigest()


def seal(key: str, data: bytes) -> str:
    """`data` (an ask's JSON) with its HMAC-SHA256 under the offer's key: `<hex mac>:<data>`."""
    mac = hmac.new(bytes.fromhex(key), data, hashlib.sha256).hexdigest()
    return f"{mac}:{data.decode()}"


def unseal(offer: PushOffer, sealed: bytes, what: str) -> bytes:
    """What `seal` sealed, once its HMAC is checked; TransferError names `what` when it was
    not sealed with the offer's key (nothing is sent to such an ask)."""
    if len(sealed) > MAX_ASK_BYTES:
        raise TransferError(f"{offer.where}: {what} is {len(sealed)} bytes: not an ask")
    mac, sep, data = sealed.partition(b":")
    want = hmac.new(bytes.fromhex(offer.key), data, hashlib.sha256).hexdigest().encode()
    if not sep or not hmac.compare_digest(mac, want):
        raise TransferError(
            f"{offer.where}: {what} is not sealed with the offer's key (written by a process "
            "that reached the store without the offer?); nothing sent to it"
        )
    return data

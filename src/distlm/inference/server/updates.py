"""New weights into the running pipeline, no restart (SGLang's route names and answer,
`{"success", "message"}`, plus what was served after it):

    POST /update_weights_from_disk          {"model_path": "/abs/results/train/final", "policy": "wait"}
    POST /update_weights_from_distributed   a sender's offer (distlm.transfer.documents.PushOffer:
        its store's host and port, the group's name, the weights' digest, ...) and "policy"; what
        the training ranks send at each checkpoint (distlm.train.pushes)

The body is checked here (a JSON object of the route's fields; `policy` wait or abort); stage
0's Updater (engine/update.py) does the rest: from disk, the folder's documents, every file's
sha256, the architecture; from a push, each stage asks the sender for its own tensors and checks
their names, shapes, dtypes and checksums; then the switch on every stage between two steps, or
none. The route answers when
the update has ended: 200 (switched, or those weights were served already), 400 (refused or not
staged: the old weights serve on, the message says why), 409 (another update is in progress),
504 (not ended within the wait; it goes on: /health names the weights served).

Who may: the bearer token's holder; a server without a token takes updates only when it listens
on a loopback address (no one else can reach it), and refuses them (403) otherwise.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from distlm.inference.messages import Error, Policy, Stall, Update, Updated, fingerprint
from distlm.inference.prompts import RequestError
from distlm.inference.server.errors import ApiError
from distlm.inference.server.requests import _validation_error, parse_json
from distlm.inference.server.state import ServeState
from distlm.transfer.documents import PUSH_ROUTE, PushOffer


class UpdateRequest(BaseModel):
    """POST /update_weights_from_disk's body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str = Field(min_length=1, max_length=4096)
    policy: Policy = "wait"

    def message(self, rid: int) -> Update:
        return Update(rid=rid, path=self.model_path, policy=self.policy)


class PushRequest(PushOffer):
    """POST /update_weights_from_distributed's body: a sender's offer, and the policy."""

    policy: Policy = "wait"

    def message(self, rid: int) -> Update:
        offer = PushOffer.model_validate(self.model_dump(exclude={"policy"}))
        return Update(rid=rid, push=offer, policy=self.policy)


# each update route and its body
ROUTES: dict[str, type[UpdateRequest | PushRequest]] = {
    "/update_weights_from_disk": UpdateRequest,
    PUSH_ROUTE: PushRequest,
}


class UpdateAnswer(BaseModel):
    """The route's answer (200 and 4xx alike: `success` says which)."""

    success: bool
    message: str
    weights: str  # the digest served after it
    system_fingerprint: str
    changed: bool
    seconds: float
    bytes: int
    stall: Stall  # what it cost the requests: new ones held, every token stopped


def loopback(host: str) -> bool:
    """Whether a listening address is reachable from this host alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def may_update(st: ServeState) -> None:
    """403 for a server without a token that others can reach (the token is checked before)."""
    if not st.token and not loopback(st.serve.host):
        raise ApiError(
            403,
            f"weight updates need a bearer token (serve.token_env or serve.token_file) on a "
            f"server that listens on {st.serve.host}; without one they are taken on a loopback "
            "address only",
            code="forbidden",
        )


def read_update(st: ServeState, raw: bytes, route: str) -> UpdateRequest | PushRequest:
    body = parse_json(raw, max_depth=st.serve.max_json_depth, max_digits=st.serve.max_number_digits)
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object")
    try:
        return ROUTES[route].model_validate(body)
    except ValidationError as e:
        raise _validation_error(e, route) from None


class _Wait:
    """The update's sink on the engine channel: its Updated, or the pipeline's failure."""

    def __init__(self) -> None:
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def put_nowait(self, msg, /) -> None:
        if not self.done.done():
            self.done.set_result(msg)


async def run_update(st: ServeState, req: UpdateRequest | PushRequest) -> tuple[UpdateAnswer, int]:
    """Send the update to stage 0 and wait for how it ended: (answer, HTTP status)."""
    engine, m = st.engine, st.metrics
    rid = engine.new_rid()
    wait = _Wait()
    t0 = time.perf_counter()
    engine.send_update(rid, req.message(rid), wait)
    # the running requests may take their whole time to end (policy wait), then the switch
    limit = 2 * st.serve.request_timeout_s + 60
    try:
        async with asyncio.timeout(limit):
            msg = await wait.done
    except TimeoutError:
        m.count(m.child(m.updates, "timeout"))
        raise ApiError(
            504,
            f"the update did not end within {limit:g} s; it goes on in the engine: /health "
            "names the weights served",
        ) from None
    finally:
        engine.forget(rid)
    if isinstance(msg, Error) or not isinstance(msg, Updated):
        raise ApiError(503, f"the pipeline is unavailable: {getattr(msg, 'message', msg)}")
    outcome = "switched" if msg.changed else ("unchanged" if msg.status == 200 else "failed")
    m.count(m.child(m.updates, outcome))
    if msg.changed:
        m.observe(m.update_seconds, time.perf_counter() - t0)
    answer = UpdateAnswer(
        success=msg.status == 200,
        message=msg.message,
        weights=msg.weights,
        system_fingerprint=fingerprint(msg.weights),
        changed=msg.changed,
        seconds=msg.seconds,
        bytes=msg.bytes,
        stall=msg.stall,
    )
    return answer, msg.status

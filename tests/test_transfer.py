"""distlm.transfer: plan and checksum units, then gloo runs on 2-4 spawned CPU processes."""

from __future__ import annotations

import itertools
import re
import sys

import pytest
import torch
from test_transfer_workers import (
    dies,
    faults,
    launch,
    mixed_state_dict,
    round_trips,
    uccl_round_trip,
)

from distlm.core.documents import encode
from distlm.runtime.dist import distributed
from distlm.settings import TransferSettings
from distlm.transfer import (
    ALIGN,
    Checksum,
    PlanMessage,
    TransferError,
    broadcast_state_dict,
    check_template,
    check_uccl,
    make_plan,
    uccl_problems,
)
from distlm.transfer.messages import MetadataCheck, read_message

# ----------------------------------------------------------------------------- units


def test_plan_covers_every_byte_once_and_splits_tensors_across_buckets():
    sd = mixed_state_dict()
    plan = make_plan(sd, bucket_mb=0.0625, chunk_mb=0.015625)
    assert plan.bucket_bytes == 65536 and plan.chunk_bytes == 16384
    assert plan.stream_bytes % ALIGN == 0
    owners = {}
    for b in range(plan.buckets):
        lo, hi = plan.bucket_range(b)
        assert sum(h - l for l, h in plan.chunks(b)) == hi - lo
        for e, off, n, at in plan.pieces(b):
            assert 0 <= at and at + n <= hi - lo
            owners.setdefault(e.name, []).append((off, n, b))
    unique = [e for e in plan.entries if e.alias is None and e.nbytes]
    for e in unique:
        parts = sorted(owners[e.name])
        assert sum(n for _, n, _ in parts) == e.nbytes
        assert all(
            a[0] + a[1] == b[0] for a, b in itertools.pairwise(parts)
        )  # contiguous, no overlap
        assert e.start % ALIGN == 0
    assert len({b for _, _, b in owners["emb.weight"]}) > 1  # the big tensor spans buckets
    tied = [e for e in plan.entries if e.alias is not None]
    assert [(e.name, e.alias) for e in tied] == [("head.weight", "emb.weight")]
    assert plan.payload_bytes == sum(
        v.numel() * v.element_size() for k, v in sd.items() if k != "head.weight"
    )
    assert "emb.weight" in plan.tensors_in(0)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_messages_cover_each_bucket_and_send_large_segments_unpacked(zero_copy):
    plan = make_plan(mixed_state_dict(), bucket_mb=0.0625, chunk_mb=0.015625)
    direct = 0
    for b in range(plan.buckets):
        covered = []
        for m in plan.messages(b, zero_copy):
            if m.direct is not None:  # straight from / into one tensor
                e, off, n = m.direct.entry, m.direct.offset, m.direct.length
                assert 0 <= off and off + n <= e.nbytes and n == m.hi - m.lo and not m.pieces
                covered.append((e.name, off, n))
                direct += n
            else:
                for e, off, n, at in m.pieces:
                    assert 0 <= at and at + n <= m.hi - m.lo
                    covered.append((e.name, off, n))
        expect = [(e.name, off, n) for e, off, n, _ in plan.pieces(b)]
        assert sorted(covered) == sorted(_split_like(expect, covered))
    assert (direct > plan.payload_bytes // 2) == zero_copy


def _split_like(expect, covered):
    """The pieces cut at the same points as the messages (messages never cross chunk ends)."""
    cuts = {}
    for name, off, n in covered:
        cuts.setdefault(name, set()).update({off, off + n})
    out = []
    for name, off, n in expect:
        points = sorted(p for p in cuts.get(name, ()) if off < p < off + n)
        edges = [off, *points, off + n]
        out += [(name, a, z - a) for a, z in itertools.pairwise(edges)]
    return out


def test_plan_message_round_trip_and_refusals():
    plan = make_plan(mixed_state_dict(), bucket_mb=1, chunk_mb=0.25)
    blob = encode(PlanMessage.of(plan))
    assert read_message(blob, PlanMessage, 0).to_plan() == plan
    other = blob.replace(b'"distlm-transfer-plan/1"', b'"distlm-transfer-plan/9"')
    with pytest.raises(
        TransferError, match=r"rank 0 sent a 'distlm-transfer-plan/9' message.*same distlm version"
    ):
        read_message(other, PlanMessage, 0)
    with pytest.raises(TransferError, match="MetadataCheck"):
        read_message(blob, MetadataCheck, 3)
    bad = blob.replace(b'"bucket_bytes":', b'"bucket_bytes":-', 1)
    with pytest.raises(TransferError, match="rank 2: malformed PlanMessage: field bucket_bytes"):
        read_message(bad, PlanMessage, 2)
    lie = PlanMessage.of(plan).model_dump()
    lie["entries"][0]["nbytes"] += 8
    with pytest.raises(TransferError, match="bytes for shape"):
        PlanMessage.model_validate(lie).to_plan()
    with pytest.raises(TransferError, match="not JSON"):
        read_message(b"\xff", PlanMessage, 1)


def test_check_template_names_the_tensor():
    sd = {"a": torch.zeros(3, 4), "b": torch.zeros(2)}
    plan = make_plan(sd, bucket_mb=1, chunk_mb=1)
    assert check_template(plan, {"a": torch.ones(3, 4), "b": torch.ones(2)}, "rank 1") == []
    [p] = check_template(plan, {"a": torch.ones(4, 3), "b": torch.ones(2)}, "rank 1")
    assert "'a'" in p and "(4, 3)" in p and "(3, 4)" in p
    [p] = check_template(
        plan, {"a": torch.ones(3, 4), "b": torch.ones(2, dtype=torch.int32)}, "rank 2"
    )
    assert "'b'" in p and "int32" in p and "float32" in p
    probs = check_template(plan, {"a": torch.ones(3, 4), "c": torch.ones(2)}, "rank 3")
    assert any("'b'" in p for p in probs) and any("'c'" in p for p in probs)


def test_checksum_detects_flipped_bits_moved_rows_and_odd_tails():
    cs = Checksum(4096, torch.device("cpu"))
    data = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    ref, out = torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    cs(data, ref)
    cs(data.clone(), out)
    assert torch.equal(ref, out)
    for pos in (0, 1, 2047, 4095):
        bad = data.clone()
        bad[pos] ^= 1
        cs(bad, out)
        assert not torch.equal(ref, out), pos
    words = data.clone().view(torch.int64)
    words[[3, 200]] = words[[200, 3]]  # words of different 1 KiB rows swapped
    if words[3] != words[200]:
        cs(words.view(torch.uint8), out)
        assert not torch.equal(ref, out)
    rows = data.clone().view(4, 1024)[[1, 0, 2, 3]].reshape(-1)  # two rows swapped
    cs(rows, out)
    assert not torch.equal(ref, out)
    odd = data[:4093]  # a tail that is not a whole word, and a view at an odd offset
    cs(odd, ref)
    bad = odd.clone()
    bad[-1] ^= 0x80
    cs(bad, out)
    assert not torch.equal(ref, out)
    cs(data[3:1003].clone(), ref)
    cs(data[3:1003], out)
    assert torch.equal(ref, out)


def test_single_rank_world_and_missing_process_group():
    with pytest.raises(TransferError, match="process group"):
        broadcast_state_dict({"a": torch.ones(2)}, settings=TransferSettings())
    with distributed(backend="gloo", timeout_s=30):
        res = broadcast_state_dict({"a": torch.ones(2)}, settings=TransferSettings(timeout_s=10))
        assert res.stats.receivers == [] and res.stats.verified


# ----------------------------------------------------------------------------- uccl


def test_uccl_is_refused_with_the_reasons_here():
    """No GPU here (and Python 3.11): the uccl transport must say why, never fall back."""
    problems = uccl_problems(torch.device("cpu"))
    if not problems:
        pytest.skip("uccl can run on this machine; the refusal is not testable")
    with distributed(backend="gloo", timeout_s=30), pytest.raises(TransferError) as err:
        broadcast_state_dict({"a": torch.ones(2)}, settings=TransferSettings(transport="uccl"))
    msg = str(err.value)
    assert "'uccl' cannot run here" in msg
    for p in problems:
        assert p in msg
    if sys.version_info < (3, 12):
        assert "Python 3.11" in msg
    if not torch.cuda.is_available():
        assert "no GPU" in msg


def test_uccl_reports_a_missing_module(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_uccl(name, *a, **kw):
        if name == "uccl" or name.startswith("uccl."):
            raise ImportError("No module named 'uccl'")
        return real(name, *a, **kw)

    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    monkeypatch.setattr(builtins, "__import__", no_uccl)
    probs = uccl_problems(torch.device("cpu"))
    assert any("from uccl import p2p" in p and "No module named" in p for p in probs)
    with pytest.raises(TransferError, match="cannot run here"):
        check_uccl(torch.device("cpu"))


def test_uccl_round_trip_where_it_runs():
    problems = uccl_problems(torch.device("cuda", 0)) if torch.cuda.is_available() else ["no GPU"]
    if not problems and torch.cuda.device_count() < 2:
        problems = [f"{torch.cuda.device_count()} GPU, the chain needs 2"]
    if problems:
        pytest.skip("uccl.p2p cannot run here: " + "; ".join(problems))
    out = launch(uccl_round_trip, 2)
    assert all(kind == "ok" for kind, _ in out.values()), out
    assert out[1][1]["identical"] and out[0][1]["stats"]["transport"] == "uccl"


# ----------------------------------------------------------------------------- multi-process (gloo)


@pytest.mark.slow
def test_round_trip_is_bit_identical_on_four_ranks():
    out = launch(round_trips, 4, 0.0625, 0.015625)
    assert all(kind == "ok" for kind, _ in out.values()), out
    sd = mixed_state_dict()
    for rank, (_, rep) in out.items():
        assert rep["identical"] == sorted(sd), (rank, set(sd) - set(rep["identical"]))
        assert rep["tied"], rank
        assert rep["in_place"], rank
    assert out[3][1]["transposed_strides"] == [
        1,
        70,
    ]  # its own non-contiguous tensor, filled in place
    src = out[0][1]["stats"]
    assert src["role"] == "sender" and src["chain"] == [0, 1, 2, 3]
    assert src["buckets"] > 4 and src["tied_tensors"] == 1 and src["tensors"] == len(sd)
    assert [r["rank"] for r in src["receivers"]] == [1, 2, 3]
    assert all(r["verified"] for r in src["receivers"]) and src["all_verified"]
    assert src["bytes"] == out[2][1]["stats"]["bytes"] > 0


def test_one_receiver_with_a_single_bucket():
    out = launch(round_trips, 2, 64, 4)
    assert all(kind == "ok" for kind, _ in out.values()), out
    assert out[0][1]["stats"]["buckets"] == 1
    assert out[1][1]["identical"] == sorted(mixed_state_dict())


@pytest.mark.slow
def test_mismatches_and_corruption_fail_every_rank_and_name_the_culprit():
    out = launch(faults, 4)
    assert all(kind == "ok" for kind, _ in out.values()), out
    for rank, (_, rep) in out.items():
        # shape on rank 2 and dtype on rank 3: everyone stops with both named
        assert (
            "tensor 'c.big' has shape (200, 201) here, the sender sends (200, 200)"
            in rep["mismatch"]
        ), rank
        assert (
            "tensor 'b.bias' has dtype float16 here, the sender sends float32" in rep["mismatch"]
        ), rank
        assert "rank 1: template tensor 'extra.weight' is not sent" in rep["names"], rank
        # corrupted at rank 2 in bucket 1: rank 2 and its successor rank 3 detect it
        assert "corrupted data" in rep["corrupt"], rank
        assert (
            "rank 2: bucket 1 chunk 0" in rep["corrupt"]
            and "rank 3: bucket 1 chunk 0" in rep["corrupt"]
        )
        assert "c.big" in rep["corrupt"]  # the tensor whose bytes sit there
        assert "rank 1:" not in rep["corrupt"].split("corrupted data")[1]
        assert rep["after"] is True
        assert rep["empty"] is True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit", "freeze"])
def test_a_dead_receiver_fails_the_others_naming_it(mode):
    out = launch(dies, 4, mode, lost=(2,), timeout=240)
    assert out[2][0] == "died"
    for rank in (0, 1, 3):
        kind, rep = out[rank]
        assert kind == "ok", (rank, rep)
        assert rep["error"] is not None, rank
        # Named either by its missing heartbeat or, when rank 0 (the store's host) has already
        # left after its own error, by the timed-out exchange with it.
        assert re.search(r"rank 2 stopped|with rank 2 timed out", rep["error"]), (
            rank,
            rep["error"],
        )
        assert rep["seconds"] < 90, rank  # timeout_s is 6: a few timeouts and probes, never a hang

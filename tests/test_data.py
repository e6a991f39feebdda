"""Dataset prep in one process (`distlm.data.prepare`, the jobs the workflow runs, in turn): every
source, the store's contract (shards behind an index), the release before's blocks bit for bit,
shards cut anywhere giving one stream, held-out splits carved by text hash, the tokenizer's
bounded sample, and every bad input named. What runs through `snakemake` (the shard cache, an
added file, a kill, the bounded memory) is tests/test_data_workflow.py."""

import hashlib
import json
import shutil

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distlm import DistlmError
from distlm.core.documents import read_document
from distlm.dag.config import deep_merge, validate_settings
from distlm.data import TokenBlocks, load_embedded, load_tokenizer, prepare, read_tokens_meta
from distlm.data.documents import DataStats, read_stats
from distlm.data.sharding import DataPlans, Layout, data_digest, plan_data
from distlm.data.tokens import FORMAT_V1, finished_v1, index_shards, read_shard_meta

SMALL = {
    "data": {"block_size": 32, "tokenizer": {"vocab_size": 512}},
    "model": {"init": {"n_positions": 64}},
}
SPLITS = ("train", "validation", "test")


def cfg(**over):
    return validate_settings(deep_merge(SMALL, over))


def run(tmp_path, c):
    out = tmp_path / "data"
    stats = prepare(
        c.data,
        c.model,
        tokens_path=out / "tokens.h5",
        tokenizer_dir=out / "tokenizer",
        stats_path=out / "stats.json",
    )
    return out, stats


def streams(out) -> dict[str, np.ndarray]:
    return {s: TokenBlocks(out / "tokens.h5", s).tokens() for s in SPLITS}


def english(n_docs=12, seed=0):
    """Real English paragraphs (from the embedded corpus) to build other sources from."""
    docs = [t for _, t in load_embedded()]
    return docs[seed : seed + n_docs]


# ----------------------------------------------------------------------------- the release before


def reference_streams(records: dict[str, list[str]], tokenizer_dir, separator="\n\n"):
    """What the release before made of a split's records: joined by the separator (none after the
    last), tokenized record by record by transformers' tokenizer, concatenated."""
    tok = load_tokenizer(tokenizer_dir)
    out = {}
    for s, recs in records.items():
        pieces = [r + separator for r in recs[:-1]] + recs[-1:]
        enc = tok(pieces, add_special_tokens=False)["input_ids"]
        out[s] = np.concatenate([np.asarray(e, dtype=np.int64) for e in enc if len(e)])
    return out


def release_before_split(docs, validation_fraction=0.05, test_fraction=0.05):
    """The release before's carving of the embedded corpus: by the rank of a hash of each name."""
    ordered = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())
    n = len(ordered)
    n_val = max(1, round(validation_fraction * n))
    n_test = max(1, round(test_fraction * n))
    parts = {
        "validation": ordered[:n_val],
        "test": ordered[n_val : n_val + n_test],
        "train": ordered[n_val + n_test :],
    }
    rank = {name: i for i, (name, _) in enumerate(docs)}
    return {s: [t for _, t in sorted(parts[s], key=lambda d: rank[d[0]])] for s in SPLITS}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embedded")
    return run(tmp, cfg())


def test_the_embedded_corpus_gives_the_release_befores_blocks(embedded, tmp_path):
    from distlm.data import train_tokenizer

    out, stats = embedded
    records = release_before_split(load_embedded())
    # the tokenizer: the release before's BPE, trained on the whole train split
    ref_tok = train_tokenizer(records["train"], 512, 2, tmp_path / "ref-tokenizer")
    assert load_tokenizer(out / "tokenizer").get_vocab() == ref_tok.get_vocab()
    ref = reference_streams(records, out / "tokenizer")
    got = streams(out)
    for s in SPLITS:
        assert np.array_equal(got[s], ref[s]), s
        assert stats.splits[s].tokens_sha256 == hashlib.sha256(ref[s].tobytes()).hexdigest()
        assert stats.splits[s].blocks == len(ref[s]) // 32
    assert stats.splits["train"].documents > 50 and stats.tokenizer.startswith("byte-level BPE")
    assert read_document(out / "stats.json", DataStats) == stats
    # the same config again: the same tokens (tokenizer training and carving are deterministic)
    _, again = run(tmp_path, cfg())
    assert {s: v.tokens_sha256 for s, v in again.splits.items()} == {
        s: v.tokens_sha256 for s, v in stats.splits.items()
    }
    text = load_tokenizer(out / "tokenizer").decode(got["train"][:400])
    assert " the " in text and "statement" in text


def test_the_store_is_shards_behind_an_index(embedded):
    out, stats = embedded
    shards = index_shards(out / "tokens.h5")
    assert [p.parent.name for p in shards] == ["shards"] and len(stats.shards) == 1
    with h5py.File(out / "tokens.h5", "r") as f:
        assert f.attrs["block_size"] == 32
        for s in SPLITS:
            ds = f[s]["tokens"]
            assert ds.is_virtual and ds.dtype == np.uint16  # any HDF5 reader sees one stream
            assert ds.shape == (stats.splits[s].tokens,)
            assert f[s].attrs["n_blocks"] == stats.splits[s].blocks
            assert np.array_equal(ds[:], TokenBlocks(out / "tokens.h5", s).tokens())
    with h5py.File(shards[0], "r") as f:
        for s in SPLITS:  # contiguous, uncompressed: mapped into memory by the trainer
            assert f[s]["tokens"].chunks is None and f[s]["tokens"].id.get_offset() is not None
    tb = TokenBlocks(out / "tokens.h5", "train")
    stream = tb.tokens()
    picked = tb[[5, 1, 3]]
    assert picked.dtype == np.int64 and picked.shape == (3, 32)
    assert np.array_equal(picked[0], stream[5 * 32 : 6 * 32]) and np.array_equal(picked[1], tb[1])
    meta = read_tokens_meta(out / "tokens.h5")
    assert meta.config_digest == stats.config_digest and meta.vocab_size == stats.vocab_size


def test_the_index_is_the_same_bytes_when_made_again(embedded, tmp_path):
    """No creation or modification time in the index: the same shards give the same file."""
    import time

    out, _ = embedded
    time.sleep(1.1)
    again, _ = run(tmp_path, cfg())
    assert (again / "tokens.h5").read_bytes() == (out / "tokens.h5").read_bytes()


def test_a_token_file_of_the_release_before_reads_and_is_kept(embedded, tmp_path):
    """One HDF5 file with each split's stream and blocks (format distlm-tokens/1): TokenBlocks
    reads it, and the workflow's gather has no input for it while it matches the config."""
    out, stats = embedded
    old = tmp_path / "old" / "tokens.h5"
    old.parent.mkdir()
    body = read_tokens_meta(out / "tokens.h5").model_dump(mode="json")
    with h5py.File(old, "w") as f:  # as the release before's write_tokens laid it out
        f.attrs["format"] = FORMAT_V1
        f.attrs["block_size"] = 32
        f.attrs["vocab_size"] = stats.vocab_size
        f.attrs["meta"] = json.dumps(body, sort_keys=True)
        for s, ids in streams(out).items():
            n = len(ids) // 32
            g = f.create_group(s)
            g.attrs["n_tokens"], g.attrs["n_blocks"] = len(ids), n
            g.create_dataset("tokens", data=ids.astype(np.uint16), chunks=(min(len(ids), 65536),))
            g.create_dataset("blocks", data=ids[: n * 32].astype(np.uint16).reshape(n, 32))
    for s in SPLITS:
        new, was = TokenBlocks(out / "tokens.h5", s), TokenBlocks(old, s)
        assert len(was) == len(new) and np.array_equal(
            was[[0, len(was) - 1]], new[[0, -1 % len(new)]]
        )
        assert np.array_equal(was.tokens(), new.tokens())
    c = cfg()
    assert finished_v1(old, data_digest(c.data, c.model))
    assert not finished_v1(old, data_digest(cfg(data={"block_size": 16}).data, c.model))
    (old.parent / "stats.json").write_text("{}")
    plans = DataPlans(Layout("s", "t", "h"), lambda: [c])
    assert (
        plans.inputs(c.data, c.model, tokens=str(old), stats=str(old.parent / "stats.json")) == {}
    )
    got = plans.inputs(
        c.data, c.model, tokens=str(out / "tokens.h5"), stats=str(out / "stats.json")
    )
    assert len(got["shards"]) == 1  # a finished index of this release: its plan's shards


# ----------------------------------------------------------------------------- shards and splits


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def test_shards_cut_anywhere_give_one_stream(tmp_path):
    """A corpus cut into many shards (byte ranges ending mid-line, small files packed) gives the
    stream one shard gives, bit for bit; a block across two shards reads whole."""
    docs = english(60, seed=5)
    files = [
        write_jsonl(tmp_path / f"part{i}.jsonl", docs[i * 20 : (i + 1) * 20]) for i in range(3)
    ]
    base = {"source": "local", "local": {"train": files}}
    one_out, one = run(tmp_path / "one", cfg(data={**base, "shard_mb": 64}))
    many_out, many = run(tmp_path / "many", cfg(data={**base, "shard_mb": 0.01}))
    assert len(one.shards) == 1 and len(many.shards) > 6
    a, b = streams(one_out), streams(many_out)
    for s in SPLITS:
        assert np.array_equal(a[s], b[s]), s
        assert one.splits[s].tokens_sha256 == many.splits[s].tokens_sha256
    assert sum(sh.documents["train"] for sh in many.shards) == one.splits["train"].documents
    tb = TokenBlocks(many_out / "tokens.h5", "train")
    assert np.array_equal(tb[list(range(len(tb)))].reshape(-1), a["train"][: len(tb) * 32])


def test_the_training_loader_reads_and_resumes_across_shards(tmp_path):
    """A step's rows from a store of many shards (blocks that cross shard boundaries among them)
    are the rows one shard gives; a loader that starts at step k (a resume, on 1 rank or 2)
    reads what the uninterrupted one read there; reads ahead are the rows asked for later."""
    import torch

    from distlm.runtime.device import DeviceBackend
    from distlm.train.step_sampler import BatchPlan, StepLoader, StepSampler

    docs = english(40, seed=11)
    files = [write_jsonl(tmp_path / f"p{i}.jsonl", docs[i * 10 : (i + 1) * 10]) for i in range(4)]
    base = {"source": "local", "local": {"train": files}}
    one_out, _ = run(tmp_path / "one", cfg(data={**base, "shard_mb": 64}))
    many_out, many = run(tmp_path / "many", cfg(data={**base, "shard_mb": 0.005}))
    assert len(many.shards) > 8
    one, split = (TokenBlocks(o / "tokens.h5", "train") for o in (one_out, many_out))
    cpu = DeviceBackend.cpu()

    def steps(blocks, plan, rank, start, n):
        loader = StepLoader(blocks, StepSampler(len(blocks), plan, rank, seed=3), cpu)
        try:
            return [torch.cat(loader(s)) for s in range(start, start + n)]
        finally:
            loader.close()

    plan = BatchPlan(4, 2, 1)
    whole = steps(one, plan, 0, 0, 12)
    assert all(torch.equal(a, b) for a, b in zip(whole, steps(split, plan, 0, 0, 12)))
    assert all(torch.equal(a, b) for a, b in zip(whole[7:], steps(split, plan, 0, 7, 5)))
    # two ranks of half the batch each read, together, the rows of the one-rank step
    two = BatchPlan(4, 1, 2)
    for s in (0, 5):
        ranks = [steps(split, two, r, s, 1)[0] for r in (0, 1)]
        assert torch.equal(torch.cat(ranks), whole[s])


def test_held_out_splits_are_carved_by_text_hash_and_kept_when_files_are_added(tmp_path):
    docs = english(70, seed=3)
    files = [write_jsonl(tmp_path / f"f{i}.jsonl", docs[i * 10 : (i + 1) * 10]) for i in range(7)]
    c = cfg(data={"source": "local", "local": {"train": files[:6]}, "validation_fraction": 0.2})
    grown = cfg(data={"source": "local", "local": {"train": files}, "validation_fraction": 0.2})

    def split_of(c, tmp):
        out, _ = run(tmp, c)
        tok = load_tokenizer(out / "tokenizer")
        got = {}
        for s, ids in streams(out).items():
            for doc in docs:
                if doc[:60] in tok.decode(ids):
                    got[doc] = s
        return got, plan_data(c.data, c.model)

    before, _ = split_of(c, tmp_path / "a")
    after, _ = split_of(grown, tmp_path / "b")
    assert {before[d] for d in before} == set(SPLITS)  # every split holds documents
    assert all(after[d] == s for d, s in before.items())  # no document moved
    # with a tokenizer whose sample the added file does not reach, the first files' shards are
    # the same jobs: the plan of the grown corpus adds the new file's shards, nothing else
    small = {"validation_fraction": 0.2, "tokenizer": {"sample_mb": 0.01}, "shard_mb": 0.02}
    plans = [
        plan_data(cfg(data={"source": "local", "local": {"train": f}, **small}).data, c.model)
        for f in (files[:6], files)
    ]
    assert plans[0].tokenizer.id == plans[1].tokenizer.id
    assert [u.file for src in plans[0].tokenizer.sample for u in src.units] == [files[0]]
    old, new = ({sh.id for sh in p.shards} for p in plans)
    assert old < new
    assert {u.file for sh in plans[1].shards if sh.id not in old for u in sh.source.units} == {
        files[6]
    }


def test_the_tokenizer_trains_on_a_bounded_sample(tmp_path):
    docs = english(40, seed=1)
    big = write_jsonl(tmp_path / "big.jsonl", docs * 3)
    c = cfg(data={"source": "local", "local": {"train": [big]}, "tokenizer": {"sample_mb": 0.02}})
    plan = plan_data(c.data, c.model)
    (sample,) = plan.tokenizer.sample
    assert sample.units[0].stop == int(0.02 * 2**20) < sample.units[0].size
    out, stats = run(tmp_path, c)
    full = cfg(data={"source": "local", "local": {"train": [big]}})
    out_full, _ = run(tmp_path / "full", full)
    assert (
        load_tokenizer(out / "tokenizer").get_vocab()
        != load_tokenizer(out_full / "tokenizer").get_vocab()
    )
    assert stats.splits["train"].tokens > 0


# ----------------------------------------------------------------------------- sources


def write_wikitext_copy(root, docs):
    """A local folder in the shape of the hub's wikitext repo: README configs + parquet per split,
    one row per line, WikiText's ' = Title = ' headings and blank lines."""
    sub = root / "wikitext-2-raw-v1"
    sub.mkdir(parents=True)

    def lines(texts):
        rows = []
        for i, t in enumerate(texts):
            rows += ["", f" = Article {i} = \n", ""]
            for para in t.split("\n\n"):
                if para.strip():
                    rows += [" " + " ".join(para.split()) + " \n", ""]
        return rows

    splits = {"train": docs[:8], "validation": docs[8:10], "test": docs[10:12]}
    for name, texts in splits.items():
        pd.DataFrame({"text": lines(texts)}).to_parquet(sub / f"{name}-00000-of-00001.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n"
        + "".join(f"  - split: {s}\n    path: wikitext-2-raw-v1/{s}-*\n" for s in splits)
        + "---\n# a local copy in the shape of wikitext\n"
    )


def test_hub_path_on_a_local_copy_gives_the_release_befores_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    root = tmp_path / "wikitext"
    write_wikitext_copy(root, english(12))
    c = cfg(data={"source": "hub", "hub": {"path": str(root), "name": "wikitext-2-raw-v1"}})
    out, stats = run(tmp_path, c)
    assert stats.source["kind"] == "hub"
    import datasets

    ds = datasets.load_dataset(str(root), "wikitext-2-raw-v1")
    # one record per row, blank lines included (each a separator), as the release before read it
    ref = reference_streams({s: list(ds[s]["text"]) for s in SPLITS}, out / "tokenizer")
    for s, ids in streams(out).items():
        assert np.array_equal(ids, ref[s]), s
    assert stats.splits["validation"].documents == sum(
        1 for t in ds["validation"]["text"] if t.strip()
    )
    assert stats.splits["train"].tokens > 1000
    # the plan names the data files under the folder as the config names it
    assert all(
        u.file.startswith(str(root))
        for sh in plan_data(c.data, c.model).shards
        for u in sh.source.units
    )

    bad = cfg(
        data={
            "source": "hub",
            "hub": {"path": str(root), "name": "wikitext-2-raw-v1", "splits": {"test": "tst"}},
        }
    )
    with pytest.raises(DistlmError, match="no split 'tst'"):
        run(tmp_path / "b", bad)
    missing = cfg(
        data={"source": "hub", "hub": {"path": "no-such-user/no-such-dataset-xyz", "name": None}}
    )
    with pytest.raises(DistlmError, match="no-such-dataset-xyz"):
        run(tmp_path / "c", missing)


def write_fineweb_standin(root, docs, files=3, row_group=4):
    """A local folder laid out like HuggingFaceFW/fineweb-edu's sample-10BT: parquet shards of a
    train split only (text and the other columns), many row groups each."""
    sub = root / "sample" / "10BT"
    sub.mkdir(parents=True)
    per = len(docs) // files
    for i in range(files):
        part = docs[i * per : (i + 1) * per]
        table = pa.table(
            {
                "text": part,
                "id": [f"<urn:uuid:{i}-{j}>" for j in range(len(part))],
                "token_count": [len(t.split()) for t in part],
                "score": [3.1] * len(part),
            }
        )
        pq.write_table(table, sub / f"{i:03d}_00000.parquet", row_group_size=row_group)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n"
        "    path: sample/10BT/*\n---\n# a stand-in in the shape of fineweb-edu\n"
    )


def test_a_hub_set_with_a_train_split_only_is_sharded_by_row_groups_and_carved(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    root = tmp_path / "fineweb-edu"
    docs = english(60, seed=2)
    write_fineweb_standin(root, docs)
    hub = {"path": str(root), "name": "sample-10BT", "splits": {"validation": None, "test": None}}
    c = cfg(data={"source": "hub", "hub": hub, "shard_mb": 0.02, "validation_fraction": 0.1})
    plan = plan_data(c.data, c.model)
    groups = sum(
        pq.ParquetFile(p).metadata.num_row_groups for p in (root / "sample/10BT").iterdir()
    )
    assert 3 < len(plan.shards) <= groups  # by row groups, packed to the shard size
    assert all(sh.source.carve is not None and sh.source.split is None for sh in plan.shards)
    out, stats = run(tmp_path, c)
    assert all(stats.splits[s].documents > 0 for s in SPLITS)
    assert sum(stats.splits[s].documents for s in SPLITS) == len(docs)
    assert "carved out of train" in stats.splits["validation"].origin
    assert read_stats(out / "stats.json").shards[0].tokens_per_s > 0


def test_local_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = english(12, seed=20)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs[:6]):
        (tmp_path / "txt" / f"doc{i}.txt").write_text(d)
    write_jsonl(tmp_path / "val.jsonl", docs[6:9])
    pd.DataFrame({"text": docs[9:12]}).to_parquet(tmp_path / "test.parquet")
    c = cfg(
        data={
            "source": "local",
            "local": {
                "train": ["txt/doc*.txt"],
                "validation": ["val.jsonl"],
                "test": ["test.parquet"],
            },
        }
    )
    out, stats = run(tmp_path, c)
    assert stats.splits["train"].documents == 6
    assert stats.splits["validation"].documents == 3
    assert stats.splits["test"].documents == 3
    ref = reference_streams(
        {"train": docs[:6], "validation": docs[6:9], "test": docs[9:12]}, out / "tokenizer"
    )
    for s, ids in streams(out).items():
        assert np.array_equal(ids, ref[s]), s
    # relative paths, as the config names them: a moved project plans the same shards
    assert plan_data(c.data, c.model).shards[0].source.units[0].file == "txt/doc0.txt"


@pytest.mark.parametrize(
    "files, message",
    [
        ({"train": ["MISSING.txt"]}, "data.local.train: corpus file not found: MISSING.txt"),
        ({"train": ["nothing-*.jsonl"]}, "data.local.train: 'nothing-\\*.jsonl' matches no file"),
        ({"train": ["EMPTY.txt"]}, "the corpus has no text: every record of EMPTY.txt is empty"),
        ({"train": ["BAD.jsonl"]}, "BAD.jsonl:2: not valid JSON"),
        ({"train": ["NOFIELD.jsonl"]}, "NOFIELD.jsonl:1: no field 'text'"),
        ({"train": ["NULL.parquet"]}, "NULL.parquet: row 1: no value in column 'text'"),
        ({"train": ["NOCOL.parquet"]}, "NOCOL.parquet: no column 'text'"),
        ({"train": ["BROKEN.parquet"]}, "BROKEN.parquet: not a readable parquet file"),
        ({"train": ["BIN.txt"]}, "BIN.txt: not UTF-8"),
        ({"train": ["doc.csv"]}, "unknown corpus format '.csv'"),
    ],
)
def test_bad_local_corpus_is_named(tmp_path, monkeypatch, files, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY.txt").write_text("  \n")
    (tmp_path / "BAD.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "NOFIELD.jsonl").write_text('{"body": "x"}\n')
    pd.DataFrame({"text": ["fine", None]}).to_parquet(tmp_path / "NULL.parquet")
    pd.DataFrame({"body": ["x"]}).to_parquet(tmp_path / "NOCOL.parquet")
    (tmp_path / "BROKEN.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "BIN.txt").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "doc.csv").write_text("text\nhello\n")
    with pytest.raises(DistlmError, match=message):
        run(tmp_path, cfg(data={"source": "local", "local": files}))
    assert not (tmp_path / "data" / "tokens.h5").exists()
    assert not (tmp_path / "data" / "stats.json").exists()
    assert not list((tmp_path / "data").rglob(".*"))  # no partial file


def test_split_with_no_block_is_named(tmp_path):
    docs = english(12)
    train = tmp_path / "train.txt"
    train.write_text("\n\n".join(docs))
    val = tmp_path / "short.txt"
    val.write_text("Too short for a block.")
    c = cfg(
        data={
            "source": "local",
            "local": {"train": [str(train)], "validation": [str(val)], "test": [str(val)]},
        }
    )
    with pytest.raises(
        DistlmError, match=r"split 'validation' .*short.txt.* fewer than data.block_size=32"
    ):
        run(tmp_path, c)
    assert not (tmp_path / "data" / "tokens.h5").exists()
    assert not (tmp_path / "data" / "tokenizer").exists()


def test_an_unreadable_shard_is_named_and_nothing_else_is_lost(tmp_path):
    docs = english(30, seed=7)
    files = [write_jsonl(tmp_path / f"p{i}.jsonl", docs[i * 10 : (i + 1) * 10]) for i in range(3)]
    fractions = {"validation_fraction": 0.2, "test_fraction": 0.2}
    c = cfg(data={"source": "local", "local": {"train": files}, "shard_mb": 0.001, **fractions})
    out, stats = run(tmp_path, c)
    shard = index_shards(out / "tokens.h5")[1]
    others = {p: p.read_bytes() for p in index_shards(out / "tokens.h5") if p != shard}
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated (a disk that failed, a bad copy)
    tb = TokenBlocks(out / "tokens.h5", "train")
    with pytest.raises(DistlmError, match=str(shard)):
        tb.tokens()
    with pytest.raises(DistlmError, match=str(shard)):  # the gather, run again, names it too
        run(tmp_path, c)
    with pytest.raises(DistlmError, match="nowhere.h5: cannot read the token shard"):
        read_shard_meta(tmp_path / "nowhere.h5")
    assert {p: p.read_bytes() for p in others} == others
    shard.unlink()  # the cure the message gives: that shard is tokenized again, alone
    _, again = run(tmp_path, c)
    assert again.splits == stats.splits


def test_a_corpus_file_gone_after_its_data_is_made_keeps_the_finished_data(tmp_path):
    docs = english(20, seed=9)
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, docs)
    fractions = {"validation_fraction": 0.2, "test_fraction": 0.2}
    c = cfg(data={"source": "local", "local": {"train": [str(path)]}, **fractions})
    out, _ = run(tmp_path, c)
    plans = DataPlans(Layout("s", "t", "h"), lambda: [c])
    tokens, stats = str(out / "tokens.h5"), str(out / "stats.json")
    want = plans.inputs(c.data, c.model, tokens=tokens, stats=stats)
    path.unlink()  # freed once tokenized
    later = DataPlans(Layout("s", "t", "h"), lambda: [c])
    assert later.inputs(c.data, c.model, tokens=tokens, stats=stats) == want
    assert "corpus file not found" in later.notes[0] and "is kept" in later.notes[0]
    with pytest.raises(DistlmError, match="corpus file not found"):
        DataPlans(Layout("s", "t", "h"), lambda: [c]).inputs(
            c.data, c.model, tokens=str(tmp_path / "none.h5"), stats=stats
        )


def test_a_hub_data_set_that_cannot_be_listed_stops_a_run_and_warns_a_dry_run(
    tmp_path, hub_offline
):
    """A login node with no network: a real run stops before any job, naming data.hub; a dry run
    plans the gather alone and says its tokenizer and shard jobs wait for the listing."""
    c = cfg(data={"source": "hub", "hub": {"path": "nobody/no-such-data-set", "name": None}})
    out = {"tokens": str(tmp_path / "tokens.h5"), "stats": str(tmp_path / "stats.json")}
    with pytest.raises(DistlmError, match="data.hub 'nobody/no-such-data-set': could not load"):
        DataPlans(Layout("s", "t", str(tmp_path / "h")), lambda: [c]).inputs(c.data, c.model, **out)
    dry = DataPlans(Layout("s", "t", str(tmp_path / "h")), lambda: [c], dry_run=lambda: True)
    assert dry.inputs(c.data, c.model, **out) == {}
    assert dry.inputs(c.data, c.model, **out) == {}  # tried once
    (note,) = dry.notes
    assert "data.hub 'nobody/no-such-data-set'" in note and "dry run plans" in note
    assert not (tmp_path / "h").exists()  # nothing kept of a listing never made


# ----------------------------------------------------------------------------- tokenizers


def test_the_tokenize_jobs_ids_are_transformers_ids(tmp_path):
    """The jobs run the folder's tokenizer.json with the tokenizers library alone; the tokenizer
    job settles the folder so that it is what transformers builds (a Llama tokenizer of an older
    transformers is rebuilt when loaded), and the ids are transformers' own."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import AutoTokenizer, LlamaTokenizerFast

    texts = [t for _, t in load_embedded()]
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(texts, vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    folder = tmp_path / "llama-style"
    LlamaTokenizerFast(
        tokenizer_object=sp._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    docs = english(8, seed=30) + ["tab\tand ünïcödé", "  two spaces", "ends with </s> too"]
    train = write_jsonl(tmp_path / "t.jsonl", docs * 4)
    c = cfg(
        data={
            "source": "local",
            "local": {"train": [train]},
            "validation_fraction": 0.2,
            "tokenizer": {"name": str(folder), "vocab_size": 600},
        }
    )
    out, stats = run(tmp_path, c)
    assert stats.tokenizer == f"{folder}'s"
    hf = AutoTokenizer.from_pretrained(out / "tokenizer")
    got = streams(out)
    recs = {s: [] for s in SPLITS}
    from distlm.data.documents import Carve
    from distlm.data.sources import hash_split

    carve = Carve(rule="hash", validation=0.2, test=0.05)
    for d in docs * 4:
        recs[hash_split(d, carve)].append(d)
    for s in SPLITS:
        pieces = [r + "\n\n" for r in recs[s][:-1]] + recs[s][-1:]
        ref = [i for e in hf(pieces, add_special_tokens=False)["input_ids"] for i in e]
        assert got[s].tolist() == ref, s
    too_small = deep_merge(c.model_dump(), {"data": {"tokenizer": {"vocab_size": 300}}})
    with pytest.raises(DistlmError, match="data.tokenizer.vocab_size: 300 is smaller"):
        run(tmp_path / "small", validate_settings(too_small))
    shutil.rmtree(tmp_path / "small", ignore_errors=True)


def test_unknown_model_id_offline_is_named(tmp_path, hub_offline):
    c = cfg(model={"source": "hub", "name": "no-such-org/no-such-model-xyz"})
    with pytest.raises(DistlmError, match="no-such-model-xyz"):
        run(tmp_path, c)

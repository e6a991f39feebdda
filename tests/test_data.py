"""Dataset prep: every source, the HDF5 contract, and every bad input named."""

import json

import h5py
import numpy as np
import pandas as pd
import pytest

from distlm import DistlmError
from distlm.core.documents import read_document
from distlm.dag.config import deep_merge, validate_settings
from distlm.data import TokenBlocks, load_embedded, prepare, read_tokens_meta
from distlm.data.documents import DataStats

SMALL = {
    "data": {"block_size": 32, "tokenizer": {"vocab_size": 512}},
    "model": {"init": {"n_positions": 64}},
}


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


def english(n_docs=12, seed=0):
    """Real English paragraphs (from the embedded corpus) to build other sources from."""
    docs = [t for _, t in load_embedded()]
    return docs[seed : seed + n_docs]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embedded")
    return run(tmp, cfg())


def test_embedded_corpus_is_real_text_and_deterministic(embedded, tmp_path):
    out, stats = embedded
    assert stats.splits["train"].documents > 50
    assert all(stats.splits[s].blocks >= 1 for s in ("train", "validation", "test"))
    assert stats.vocab_size <= 512 and stats.tokenizer.startswith("byte-level BPE")
    assert read_document(out / "stats.json", DataStats) == stats
    # Same config -> same tokens (tokenizer training and splitting are deterministic).
    _, again = run(tmp_path, cfg())
    assert {s: v.tokens_sha256 for s, v in again.splits.items()} == {
        s: v.tokens_sha256 for s, v in stats.splits.items()
    }
    # The text is English prose, and the tokenizer round-trips it.
    from distlm.data import load_tokenizer

    tok = load_tokenizer(out / "tokenizer")
    text = tok.decode(TokenBlocks(out / "tokens.h5", "train").tokens()[:400])
    assert " the " in text and "statement" in text


def test_hdf5_contract(embedded):
    out, stats = embedded
    with h5py.File(out / "tokens.h5", "r") as f:
        assert f.attrs["block_size"] == 32
        for split in ("train", "validation", "test"):
            blocks, tokens = f[split]["blocks"], f[split]["tokens"]
            assert blocks.chunks is not None and blocks.chunks[1] == 32  # streamable by rows
            assert blocks.shape == (stats.splits[split].blocks, 32)
            assert np.array_equal(blocks[:].reshape(-1), tokens[: blocks.shape[0] * 32])
    tb = TokenBlocks(out / "tokens.h5", "train")
    picked = tb[[5, 1, 3]]
    assert picked.dtype == np.int64 and picked.shape == (3, 32)
    assert np.array_equal(picked[0], tb[5]) and np.array_equal(picked[1], tb[1])
    assert read_tokens_meta(out / "tokens.h5").config_digest == stats.config_digest


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


def test_hub_path_on_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    root = tmp_path / "wikitext"
    write_wikitext_copy(root, english(12))
    c = cfg(data={"source": "hub", "hub": {"path": str(root), "name": "wikitext-2-raw-v1"}})
    _out, stats = run(tmp_path, c)
    assert stats.source["kind"] == "hub"
    # One record per line, blank lines included, as in WikiText.
    import datasets

    ds = datasets.load_dataset(str(root), "wikitext-2-raw-v1")
    assert stats.splits["validation"].documents == sum(
        1 for t in ds["validation"]["text"] if t.strip()
    )
    assert stats.splits["train"].tokens > 1000

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


def test_local_sources(tmp_path):
    docs = english(12, seed=20)
    txt = []
    for i, d in enumerate(docs[:6]):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(d)
        txt.append(str(p))
    jl = tmp_path / "val.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[6:9]))
    pq = tmp_path / "test.parquet"
    pd.DataFrame({"text": docs[9:12]}).to_parquet(pq)
    c = cfg(
        data={
            "source": "local",
            "local": {"train": txt, "validation": [str(jl)], "test": [str(pq)]},
        }
    )
    _, stats = run(tmp_path, c)
    assert stats.splits["train"].documents == 6
    assert stats.splits["validation"].documents == 3
    assert stats.splits["test"].documents == 3


@pytest.mark.parametrize(
    "files, message",
    [
        ({"train": ["MISSING.txt"]}, "corpus file not found: MISSING.txt"),
        ({"train": ["EMPTY.txt"]}, "EMPTY.txt: corpus file is empty"),
        ({"train": ["BAD.jsonl"]}, "BAD.jsonl:2: not valid JSON"),
        ({"train": ["NOFIELD.jsonl"]}, "NOFIELD.jsonl:1: no field 'text'"),
        ({"train": ["BIN.txt"]}, "BIN.txt: not UTF-8"),
        ({"train": ["doc.csv"]}, "unknown corpus format '.csv'"),
    ],
)
def test_bad_local_corpus_is_named(tmp_path, monkeypatch, files, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY.txt").write_text("  \n")
    (tmp_path / "BAD.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "NOFIELD.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "BIN.txt").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "doc.csv").write_text("text\nhello\n")
    with pytest.raises(DistlmError, match=message):
        run(tmp_path, cfg(data={"source": "local", "local": files}))
    assert not (tmp_path / "data" / "tokens.h5").exists()
    assert not (tmp_path / "data" / "stats.json").exists()


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


def test_unknown_model_id_offline_is_named(tmp_path, hub_offline):
    c = cfg(model={"source": "hub", "name": "no-such-org/no-such-model-xyz"})
    with pytest.raises(DistlmError, match="no-such-model-xyz"):
        run(tmp_path, c)

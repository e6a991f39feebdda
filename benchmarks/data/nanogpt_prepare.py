"""nanoGPT's `data/openwebtext/prepare.py`, with a transformers tokenizer in place of tiktoken's
GPT-2: the baseline the data stage is measured against (benchmarks/data/bench_prep.py).

    python benchmarks/data/nanogpt_prepare.py CORPUS.jsonl TOKENIZER_DIR OUT_DIR --num-proc 2

As nanoGPT does: `datasets.load_dataset("json")`, a 0.05% validation split, `map` over the
documents in `num_proc` processes (each document's ids and the end-of-text id), then one
`np.memmap` uint16 file per split written in 1,024 batches. Prints one JSON line: tokens per split
and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("corpus")
    p.add_argument("tokenizer")
    p.add_argument("out")
    p.add_argument("--num-proc", type=int, default=2)
    args = p.parse_args()
    t0 = time.perf_counter()
    from datasets import load_dataset
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    eot = tok.eos_token_id
    os.makedirs(args.out, exist_ok=True)
    dataset = load_dataset(
        "json", data_files=args.corpus, num_proc=args.num_proc, cache_dir=f"{args.out}/cache"
    )
    split_dataset = dataset["train"].train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    split_dataset["val"] = split_dataset.pop("test")

    def process(example):
        ids = tok(example["text"], add_special_tokens=False)["input_ids"]
        ids.append(eot)
        return {"ids": ids, "len": len(ids)}

    tokenized = split_dataset.map(
        process, remove_columns=["text"], desc="tokenizing the splits", num_proc=args.num_proc
    )
    tokens = {}
    for split, dset in tokenized.items():
        arr_len = np.sum(dset["len"], dtype=np.uint64)
        filename = os.path.join(args.out, f"{split}.bin")
        arr = np.memmap(filename, dtype=np.uint16, mode="w+", shape=(int(arr_len),))
        total_batches = min(1024, len(dset))
        idx = 0
        for batch_idx in tqdm(range(total_batches), desc=f"writing {filename}"):
            batch = dset.shard(num_shards=total_batches, index=batch_idx, contiguous=True)
            arr_batch = np.concatenate(batch.with_format("numpy")["ids"])
            arr[idx : idx + len(arr_batch)] = arr_batch
            idx += len(arr_batch)
        arr.flush()
        tokens[split] = int(arr_len)
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()

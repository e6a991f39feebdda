"""The engines a CPU user picks for speed, on the weights distlm writes: CTranslate2 and llama.cpp.

    pip install -e '.[bench]'   # ctranslate2 (a wheel) and llama-cpp-python[server] (builds llama.cpp)
    python benchmarks/inference/peers.py ct2 --model results/train/final --out ct2-model
    python benchmarks/inference/peers.py gguf --model results/train/final --outtype f16 \
        --llama-cpp llama_cpp_python-0.3.36/vendor/llama.cpp --out model-f16.gguf

bench.py times CTranslate2's `Generator.generate_batch` beside Hugging Face `generate` and the
pipeline; bench_serve.py serves the GGUF file with llama.cpp's `llama-server` (continuous batching,
one slot per lane) beside `transformers serve` and distlm.

CTranslate2's `ct2-transformers-converter` reads a GPT-2 folder as distlm writes it (float32).
llama.cpp's `convert_hf_to_gguf.py` (in the llama.cpp source the server is built from: the
llama-cpp-python source distribution carries it under vendor/llama.cpp) refuses it twice, and
`gguf` below converts a copy of the folder (the same weights and tokenizer files) that answers both:
  * KeyError 'n_ctx': its GPT-2 converter reads the context length from `n_ctx`, a key of OpenAI's
    original GPT-2 config.json that transformers' GPT2Config no longer writes (it writes
    `n_positions`, the same number). The copy's config.json adds n_ctx = n_positions.
  * NotImplementedError "BPE pre-tokenizer was not recognized - update get_vocab_base_pre()": it
    names a BPE tokenizer's pre-tokenizer by a hash of the token ids of a fixed text, and only
    published tokenizers' hashes are in its table, so any newly trained vocabulary (the default
    4096-token one) is refused. Its pre-tokenizer is GPT-2's own (ByteLevel, GPT-2's split regex,
    no prefix space, no normalizer), which is llama.cpp's "gpt-2" pre-tokenizer: the converter runs
    with that answer after tokenizer.json is checked to say exactly that.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# tokenizer.json's pre_tokenizer that is llama.cpp's "gpt-2" pre-tokenizer (trim_offsets only
# moves offsets, never token ids)
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


# ----------------------------------------------------------------------------- CTranslate2


def ct2_model(model_dir: Path, out: Path) -> Path:
    """`ct2-transformers-converter --model model_dir --output_dir out` (float32), once."""
    if not (out / "model.bin").exists():
        cmd = [sys.executable, "-m", "ctranslate2.converters.transformers"]
        cmd += ["--model", str(model_dir), "--output_dir", str(out), "--quantization", "float32"]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"ct2-transformers-converter {model_dir} failed:\n{r.stderr[-3000:]}")
    return out


def ct2_runner(
    ct2_dir: Path, tokenizer, texts: list[str], n: int, threads: int
) -> Callable[[], dict]:
    """A callable timing CTranslate2's Generator.generate_batch over all prompts at once: greedy
    (top-1, one beam), exactly n new tokens (min_length = max_length = n, as `generate`'s
    min_new_tokens), on `threads` threads."""
    # the bench extra: CI's type checker runs without it
    import ctranslate2  # pyright: ignore[reportMissingImports]

    gen = ctranslate2.Generator(str(ct2_dir), device="cpu", inter_threads=1, intra_threads=threads)
    batch = [
        tokenizer.convert_ids_to_tokens(tokenizer(t, add_special_tokens=False)["input_ids"])
        for t in texts
    ]

    def run() -> dict:
        t0 = time.perf_counter()
        res = gen.generate_batch(
            batch,
            max_length=n,
            min_length=n,
            beam_size=1,
            sampling_topk=1,
            include_prompt_in_result=False,
        )
        wall = time.perf_counter() - t0
        ids = [r.sequences_ids[0] for r in res]
        total = sum(len(x) for x in ids)
        return {
            "tokens": total,
            "wall_s": wall,
            "tokens_per_s": total / wall,
            "threads": threads,
            "token_ids": ids,
        }

    return run


# ----------------------------------------------------------------------------- llama.cpp


def check_gpt2_pre_tokenizer(model_dir: Path) -> None:
    """Refuse a tokenizer whose pre-tokenization is not GPT-2's (the "gpt-2" answer is wrong)."""
    path = model_dir / "tokenizer.json"
    doc = json.loads(path.read_text())
    model, pre = doc.get("model", {}).get("type"), doc.get("pre_tokenizer") or {}
    got = {k: pre.get(k) for k in GPT2_PRE_TOKENIZER}
    if model != "BPE" or got != GPT2_PRE_TOKENIZER or doc.get("normalizer") is not None:
        raise SystemExit(
            f"{path}: model.type {model!r}, pre_tokenizer {got}, normalizer "
            f"{doc.get('normalizer')!r}: not GPT-2's byte-level BPE (model.type 'BPE', "
            f"pre_tokenizer {GPT2_PRE_TOKENIZER}, no normalizer), so it is not llama.cpp's "
            "'gpt-2' pre-tokenizer"
        )


def gguf_model(model_dir: Path, out: Path, outtype: str, llama_cpp: Path) -> Path:
    """`convert_hf_to_gguf.py` of llama.cpp's source tree `llama_cpp` on a copy of `model_dir`
    (see the module docstring): a GGUF file of type `outtype` (f32, f16), once."""
    if out.exists():
        return out
    script = llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(
            f"--llama-cpp {llama_cpp}: no convert_hf_to_gguf.py (a llama.cpp source tree; the "
            "llama-cpp-python source distribution has one under vendor/llama.cpp)"
        )
    check_gpt2_pre_tokenizer(model_dir)
    src = out.parent / f"{out.name}.src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (src / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config.setdefault("n_ctx", config["n_positions"])
    (src / "config.json").write_text(json.dumps(config, indent=2))
    part = out.parent / f"{out.name}.part"
    cmd = [sys.executable, __file__, "convert-gguf", str(llama_cpp), str(src)]
    cmd += ["--outtype", outtype, "--outfile", str(part)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    shutil.rmtree(src, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(
            f"convert_hf_to_gguf.py {model_dir} ({outtype}) failed:\n{r.stderr[-3000:]}"
        )
    part.rename(out)
    return out


def convert_gguf(llama_cpp: Path, argv: list[str]) -> None:
    """Run convert_hf_to_gguf.py with argv, naming the pre-tokenizer "gpt-2" (checked before)."""
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    # llama.cpp's converter package, in its source tree (not installed)
    from conversion.base import TextModel  # pyright: ignore[reportMissingImports]

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")


def llama_server_command(
    binary: str, gguf: Path, *, port: int, threads: int, slots: int, context: int
) -> list[str]:
    """llama.cpp's own server: continuous batching over `slots` sequences of `context` tokens
    each (the KV cache holds slots x context), `threads` threads for decoding and prompts."""
    exe = shutil.which(binary)
    if exe is None:
        raise SystemExit(
            f"--llama-server {binary}: not found (build llama.cpp's tools/server; the "
            "llama-cpp-python build makes it with CMAKE_ARGS='-DLLAMA_BUILD_TOOLS=ON "
            "-DLLAMA_BUILD_SERVER=ON')"
        )
    return [
        exe,
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * context),
        "--cont-batching",
        "--no-webui",
        "--log-disable",
    ]


def llama_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


# ----------------------------------------------------------------------------- command line


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("ct2", help="convert a model folder for CTranslate2 (float32)")
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    g = sub.add_parser("gguf", help="convert a model folder to a GGUF file")
    g.add_argument("--model", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--outtype", choices=["f32", "f16"], default="f32")
    g.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf)")
    v = sub.add_parser("convert-gguf", help=argparse.SUPPRESS)
    v.add_argument("llama_cpp")
    v.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.cmd == "ct2":
        print(ct2_model(Path(args.model), Path(args.out)))
    elif args.cmd == "gguf":
        print(gguf_model(Path(args.model), Path(args.out), args.outtype, Path(args.llama_cpp)))
    else:
        convert_gguf(Path(args.llama_cpp), args.argv)


if __name__ == "__main__":
    main()

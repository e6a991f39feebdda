"""The inference stage: a prompt file through the pipeline; generations (JSONL) and timing out.

    mpiexec -n S python -m distlm.entry.infer --config results/config/inference.json ...

Every rank calls run_batch; stages 1..S-1 serve until stage 0 stops them, stage 0 prepares every
prompt (request.prepare, the same path as the API server's), runs them all through the
scheduler's loop and writes the two files.
"""

from __future__ import annotations

import json
import time

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.core.io import atomic_path
from distlm.core.log import get_logger
from distlm.inference.documents import InferenceTiming, Ttft
from distlm.inference.engine.bootstrap import Pipeline, mpi_pipeline, run_workers
from distlm.inference.engine.scheduler import Sequence, run_stage0
from distlm.inference.prompts import RequestError, read_prompts
from distlm.inference.request import prepare_request, sampling_settings
from distlm.settings import InferenceSettings, derived_seed

log = get_logger(__name__)


def batch_error(e: RequestError, *, source: str, prompt: int) -> DistlmError:
    """A neutral RequestError named as the batch stage names things: a prompt of the prompt
    file, or the config key inference.<field>."""
    if e.param == "prompt":
        return DistlmError(f"{source}: prompt {prompt + 1}: {e}")
    return DistlmError(f"config {e.named(f'inference.{e.param}')}")


def generate_batch(
    pipe: Pipeline, prompts: list[str], settings: InferenceSettings, *, source: str = "prompts"
) -> tuple[list[dict], InferenceTiming]:
    """Stage 0: run every prompt through the pipeline; (generation records, timing summary)."""
    sched, tok = pipe.stage0, pipe.tokenizer
    seqs, dropped = [], []
    for i, text in enumerate(prompts):
        try:
            # each prompt its own seed: the i-th after inference.seed
            sampling = sampling_settings(
                {"seed": derived_seed(settings.seed, i)}, defaults=settings
            )
            req = prepare_request(
                [text],
                sampling,
                tokenizer=tok,
                context=pipe.context,
                overflow=settings.prompt_overflow,
            )
        except RequestError as e:
            raise batch_error(e, source=source, prompt=i) from None
        cut = req.truncated[0]
        if cut:
            log.warning(
                "%s: prompt %d: dropped its first %d tokens to fit the context", source, i + 1, cut
            )
        seqs.append(Sequence(sched.new_id(), req.ids[0], req.params))
        dropped.append(cut)
    t0 = time.perf_counter()
    for s in seqs:
        s.t_submit = t0
        sched.submit(s)
    run_stage0(sched, more=lambda: sched.busy)
    wall = time.perf_counter() - t0
    records = []
    for i, (text, s, cut) in enumerate(zip(prompts, seqs, dropped)):
        records.append(
            {
                "index": i,
                "prompt": text,
                "text": tok.decode(s.tokens, skip_special_tokens=True),
                "tokens": len(s.tokens),
                "token_ids": s.tokens,
                "finish_reason": s.finish_reason,
                "prompt_tokens": len(s.prompt_ids),
                "prompt_truncated_tokens": cut,
                **{k: v for k, v in s.timing().items() if k != "tokens"},
            }
        )
    total = sum(len(s.tokens) for s in seqs)
    timing = InferenceTiming(
        stages=pipe.topo.world_size,
        lanes=settings.lanes,
        micro_batch_size=sched.cap,
        prompts=len(seqs),
        tokens=total,
        wall_s=wall,
        tokens_per_s=total / wall if wall > 0 else None,
        ttft_s=Ttft(
            mean=sum(s.t_first - s.t_submit for s in seqs) / len(seqs),
            max=max(s.t_first - s.t_submit for s in seqs),
        ),
        per_prompt=[{"index": r["index"], **seqs[i].timing()} for i, r in enumerate(records)],
    )
    return records, timing


def run_batch(
    settings: InferenceSettings,
    *,
    model_dir,
    prompts_path,
    generations_path,
    timing_path,
    device: str = "cpu",
) -> None:
    """The inference stage: every rank calls this; stage 0 writes the generations and the timing."""
    with mpi_pipeline(settings, model_dir, device=device) as pipe:
        if not run_workers(pipe):
            return
        prompts = read_prompts(prompts_path)
        records, timing = generate_batch(pipe, prompts, settings, source=str(prompts_path))
        timing = timing.model_copy(
            update={
                "per_stage": pipe.stage0.stop(),
                "hosts": [i.to_dict() for i in pipe.infos],
                "model": str(model_dir),
            }
        )
        with atomic_path(generations_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        write_document(timing_path, timing)
        log.info(
            "%d prompts, %d tokens in %.2f s: %.1f tokens/s over %d stages",
            timing.prompts,
            timing.tokens,
            timing.wall_s,
            timing.tokens_per_s or 0,
            timing.stages,
        )

"""Checks of the training stage's parallel layouts (distlm.train.parallel) on gloo ranks, run under
torchrun by tests/test_fsdp.py: one launch for many runs of the stage's `Trainer`, each a few
steps of its real loop, measured as they go.

    PYTHONPATH=tests torchrun --nproc-per-node=4 -m harness.layout_check INPUTS OUT RUNS.json

INPUTS holds the tiny workflow's results/ (token file, base model); RUNS.json maps a run's name
to a TrainConfig document and its steps. Each rank writes OUT/rank<r>.json:

- per run: the losses of its steps; the most tensor bytes the rank held during start-up (after
  the layout built the model, while weights were read: each parameter's rows, or a whole
  folder's tensors beside the model, and after the starting weights) and after each micro-step's
  backward pass (tests/harness/held.py); what the admission check predicted (its parts); the
  bytes autograd saved for one forward pass (activations); the validation loss;
- "mesh": under fsdp the parameters' device mesh is the topology's, and FSDP's default mesh is
  never made (it raises here);
- "reshard": the fused-head loss of a sharded model and its gradients are the same when the root
  is resharded right after its forward pass as when it is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch
from harness.held import SavedBytes, held_bytes

from distlm.core.documents import read_document
from distlm.family.transformer import TensorMap, Transformer
from distlm.model import read_args
from distlm.runtime.device import DeviceBackend, resolve_precision
from distlm.runtime.dist import distributed
from distlm.settings.train import TrainConfig
from distlm.train import TrainPaths
from distlm.train.parallel import layout_for
from distlm.train.trainer import Trainer


@contextlib.contextmanager
def sampled_during_start(samples: list[int]):
    """`samples` gets the tensor bytes held at each point of a start-up where the most is held:
    after each parameter's rows are read (fsdp), and at the end of a whole folder's load, its
    tensors beside the model's (ddp's rank 0)."""
    rows, load_hf = TensorMap.rows, Transformer.load_hf

    def sampled_rows(self, *a, **kw):
        out = rows(self, *a, **kw)
        samples.append(held_bytes(collect=False))  # garbage too: at most an overcount
        return out

    def sampled_load(self, *a, **kw):
        load_hf(self, *a, **kw)
        samples.append(held_bytes())

    TensorMap.rows, Transformer.load_hf = sampled_rows, sampled_load
    try:
        yield
    finally:
        TensorMap.rows, Transformer.load_hf = rows, load_hf


def stage_paths(inputs: Path, out: Path) -> TrainPaths:
    """The train stage's paths on the tiny workflow's inputs, writing into `out`."""
    r = inputs / "results"
    return TrainPaths(
        tokens=r / "data/tokens.h5",
        model=r / "model/base",
        tokenizer=r / "data/tokenizer",
        out=out,
    )


def run(name: str, spec: dict, inputs: Path, out: Path, topo) -> dict:
    cfg = read_document(spec["config"], TrainConfig)
    paths = stage_paths(inputs, out / name)
    precision = resolve_precision(cfg.train.precision, torch.device("cpu"), key="train.precision")
    topo = dataclasses.replace(
        topo, device_backend=DeviceBackend(torch.device("cpu"), precision=precision)
    )
    measure = spec.get("measure", False)
    base = held_bytes() if measure else 0  # the process's before: earlier runs' leftovers
    start: list[int] = []
    with sampled_during_start(start) if measure else contextlib.nullcontext():
        trainer = Trainer(cfg, paths, topo)
    after_backward: list[int] = []
    if measure:
        start.append(held_bytes())
        real = trainer.layout.micro_step

        @contextlib.contextmanager
        def measured(*, last: bool):
            with real(last=last):
                yield
            if trainer.step > 0:  # AdamW's state made: the steady state, micro-step by micro-step
                after_backward.append(held_bytes())

        trainer.layout.micro_step = measured  # pyright: ignore[reportAttributeAccessIssue]
    try:
        losses = [trainer.step_and_log()["loss"] for _ in range(spec["steps"])]
        val = trainer.evaluate()["val_loss"]
        x = trainer.data.loader(0)[0]
        with SavedBytes(trainer.model.parameters()) as saved, trainer.hw.autocast():
            loss = trainer.fwd(x)
        loss.backward()
        trainer.optimizer.zero_grad(set_to_none=True)
    finally:
        trainer.close()
    p = trainer.predicted
    return {
        "losses": losses,
        "val_loss": val,
        "startup_bytes": max(start) - base if measure else None,
        "after_backward_bytes": max(after_backward) - base if measure else None,
        "predicted": {"state": p.state, "accumulated": p.accumulated, "gathered": p.gathered},
        "activation_bytes": saved.bytes,
        "grad_accum": trainer.data.plan.grad_accum,
    }


def check_mesh(spec: dict, inputs: Path, topo) -> dict:
    """A sharded layout's model over the topology's mesh; FSDP's default never made."""
    import torch.distributed.fsdp._fully_shard._fully_shard as fs

    defaults = [
        n for n in ("_init_default_mesh", "_init_default_fully_shard_mesh") if hasattr(fs, n)
    ]
    assert defaults, "torch's fully_shard has none of the default-mesh functions this test knows"
    cfg = read_document(spec["config"], TrainConfig)
    layout = layout_for(cfg.train, topo)

    def refused():
        raise AssertionError("fully_shard made its default mesh")

    saved = {n: getattr(fs, n) for n in defaults}
    for n in defaults:
        setattr(fs, n, refused)
    try:
        folder = inputs / "results/model/base"
        model = layout.build(folder, read_args(folder))
    finally:
        for n, f in saved.items():
            setattr(fs, n, f)
    meshes = [p.device_mesh for p in model.parameters()]  # pyright: ignore
    types = {m.device_type for m in meshes}
    return {
        "one_mesh_the_topologys": all(m == layout.mesh for m in meshes),
        "device_types": sorted(types),
        "mesh_ranks": layout.mesh.size(),
    }


def check_reshard(spec: dict, inputs: Path, out: Path, topo) -> dict:
    """The fused-head loss (the CPU's kernels) and its gradients of a sharded model, with and
    without the root resharded right after its forward pass (FSDPModule.reshard)."""
    cfg = read_document(spec["config"], TrainConfig)
    paths = stage_paths(inputs, out / "reshard")
    trainer = Trainer(cfg, paths, topo)
    try:
        model, fwd = trainer.model, trainer.fwd
        x = trainer.data.loader(0)[0]

        def loss_and_grads():
            loss = fwd(x)
            loss.backward()
            grads = [p.grad.full_tensor().clone() for p in model.parameters()]  # pyright: ignore
            trainer.optimizer.zero_grad(set_to_none=True)
            return loss.item(), grads

        plain, plain_grads = loss_and_grads()
        hook = model.register_forward_hook(lambda m, i, o: m.reshard())  # pyright: ignore
        try:
            early, early_grads = loss_and_grads()
        finally:
            hook.remove()
    finally:
        trainer.close()
    return {
        "module": type(fwd).__name__,
        "plain": plain,
        "resharded": early,
        "same_grads": all(torch.equal(a, b) for a, b in zip(plain_grads, early_grads, strict=True)),
    }


def main() -> None:
    inputs, out, runs_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    runs = json.loads(runs_file.read_text())
    with distributed(backend="gloo", device="cpu", timeout_s=60) as topo:
        results: dict = {}
        for name, spec in runs.items():
            if name == "mesh":
                results[name] = check_mesh(spec, inputs, topo)
            elif name == "reshard":
                results[name] = check_reshard(spec, inputs, out, topo)
            else:
                results[name] = run(name, spec, inputs, out, topo)
        (out / f"rank{topo.rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

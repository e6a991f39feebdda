"""Test faults for a training stage started as the user starts it (tests/harness/faults.py).
Python imports this module at start-up when its folder is on PYTHONPATH (`fault_env`, `paced_env`
put it there); it acts only in a training rank (RANK set):

- when DISTLM_TEST_FAULTS names a spec file (a JSON object of FaultSpec's fields; another field is
  a TypeError naming it), it sets distlm.train.faults.REQUESTED from it;
- when DISTLM_TEST_STEP_S is set, every training step takes at least that many seconds (the rank
  sleeps out the rest), so a test that trains across SLURM time limits knows how many steps an
  allocation holds whatever the machine's speed, and its idle ranks leave the CPU to other work;
  when DISTLM_TEST_HOLD also names a file, a step does not end while that file exists, and the
  rank creates that name + ".reached" (a test holds a job in training until it has done what
  must happen meanwhile);
- when DISTLM_TEST_BACKGROUND_CHECKPOINTS is set, the rank writes its checkpoints as on a GPU
  (DeviceBackend's `background_checkpoints`): copies to host memory, written in a thread;
- when DISTLM_TEST_SAVE_FAULT holds {"rank": R, "at": "open" | "shards"}, rank R's first sharded
  checkpoint fails as a full disk fails it: rank 0 opening the checkpoint's temporary folder
  ("open"), or rank R writing its shards into it ("shards"), with ENOSPC naming the path.

Nothing else changes: the steps compute what they compute without it."""

import json
import os

SPEC = os.environ.get("DISTLM_TEST_FAULTS")
if SPEC and "RANK" in os.environ:
    from distlm.train import faults

    with open(SPEC, encoding="utf-8") as f:
        faults.REQUESTED = faults.FaultSpec(**json.load(f))

STEP_S = os.environ.get("DISTLM_TEST_STEP_S")
if STEP_S and "RANK" in os.environ:
    import time

    from distlm.train import trainer

    _pace, _step = float(STEP_S), trainer.Trainer.train_step
    _hold = os.environ.get("DISTLM_TEST_HOLD")

    def _paced_step(self):
        started = time.monotonic()
        row = _step(self)
        time.sleep(max(0.0, _pace - (time.monotonic() - started)))
        while _hold and os.path.exists(_hold):
            open(_hold + ".reached", "a").close()
            time.sleep(_pace)
        return row

    trainer.Trainer.train_step = _paced_step

if os.environ.get("DISTLM_TEST_BACKGROUND_CHECKPOINTS") and "RANK" in os.environ:
    import dataclasses

    from distlm.runtime.device import DeviceBackend

    _for_rank = DeviceBackend.for_rank

    def _background(cls, *args, **kw):
        return dataclasses.replace(_for_rank(*args, **kw), background_checkpoints=True)

    DeviceBackend.for_rank = classmethod(_background)

SAVE_FAULT = os.environ.get("DISTLM_TEST_SAVE_FAULT")
if SAVE_FAULT and "RANK" in os.environ:
    _fault = json.loads(SAVE_FAULT)
    if int(os.environ["RANK"]) == _fault["rank"]:
        import errno

        from distlm.train import checkpoint_save
        from distlm.train.checkpoint_writer import CheckpointWriter

        def _full(path):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        if _fault["at"] == "open":

            def _no_room(path, **kw):
                raise _full(path)

            checkpoint_save.atomic_dir = _no_room
        else:

            def _no_room_for_shards(self, tree, where):
                raise _full(where / f"__{_fault['rank']}_0.distcp")

            CheckpointWriter.save_shards = _no_room_for_shards

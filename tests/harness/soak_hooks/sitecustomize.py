"""Windows for tests/test_kill_soak.py inside every checkpoint write and the final write of the
training stage, so the soak can kill the user's command there, not only wherever a random moment
falls. Python imports this module at start-up when its folder is on PYTHONPATH (the soak puts it
there); it acts only in a training rank (RANK set) of a soak (DISTLM_SOAK_EVENTS set). Rank 0
appends `ckpt-write PATH` once a checkpoint's files are written (a sharded one's shards too) and
its index is, the folder not yet renamed, and `final-write PATH` once the final folder's weights
file is, then waits DISTLM_SOAK_WINDOW_S seconds; nothing else changes."""

import os
import time

EVENTS = os.environ.get("DISTLM_SOAK_EVENTS")
if EVENTS and "RANK" in os.environ:
    import distlm.model.folder as model_mod  # write_model_dir saves through its name
    import distlm.train.checkpoint as ckpt_mod

    WINDOW_S = float(os.environ.get("DISTLM_SOAK_WINDOW_S", "0.3"))

    def window(what: str, path) -> None:
        with open(EVENTS, "a", encoding="utf-8") as f:
            f.write(f"{what} {path}\n")
        time.sleep(WINDOW_S)

    def windowed_index(real):
        def write_index(tmp, step):
            real(tmp, step)
            window("ckpt-write", tmp)

        return write_index

    def windowed_save(real):
        def save(tensors, path):
            real(tensors, path)
            window("final-write", path)

        return save

    ckpt_mod.write_index = windowed_index(ckpt_mod.write_index)
    model_mod.save_safetensors = windowed_save(model_mod.save_safetensors)

"""The training entry point (workflow/scripts/train.py) with a window inside every checkpoint write
and inside the final write, so that tests/test_kill_soak.py can kill -9 the job there, not only
wherever a random moment falls. Rank 0 appends `ckpt-write PATH` / `final-write PATH` to the file
named by DISTLM_SOAK_EVENTS when its weights file is written and the folder not yet renamed, then
waits DISTLM_SOAK_WINDOW_S seconds; nothing else changes."""

import os
import runpy
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "workflow" / "scripts" / "train.py"
# as if SCRIPT were run: its folder first on the path, not this one (tests/harness/profile.py
# would shadow the standard library's profile module)
sys.path[0] = str(SCRIPT.parent)

import distlm.model as model_mod
import distlm.train.checkpoint as ckpt_mod

EVENTS = os.environ["DISTLM_SOAK_EVENTS"]
WINDOW_S = float(os.environ.get("DISTLM_SOAK_WINDOW_S", "0.3"))


def windowed(real, what: str):
    def save(tensors, path, metadata=None):
        real(tensors, path, metadata)
        with open(EVENTS, "a", encoding="utf-8") as f:
            f.write(f"{what} {path}\n")
        time.sleep(WINDOW_S)

    return save


ckpt_mod.save_safetensors = windowed(ckpt_mod.save_safetensors, "ckpt-write")
model_mod.save_safetensors = windowed(model_mod.save_safetensors, "final-write")
sys.argv = [str(SCRIPT), *sys.argv[1:]]
runpy.run_path(str(SCRIPT), run_name="__main__")

"""What a process of a stage loaded and what its start-up cost, for tests/test_family_model.py's
check of every entry point and benchmarks/train/startup.py. Python imports this module at
start-up when its folder is on PYTHONPATH (`process_env` in tests/harness/faults.py puts it
there) and DISTLM_TEST_PROCESS names a folder; it then writes, when the process exits normally,
`<folder>/<pid>.json`: the command line, every module in sys.modules, and the process's CPU
seconds (user + system, all its threads) at the start of its first training step (when it
trains) and at its exit. It imports nothing beyond the standard library itself, and patches
distlm.train.trainer's `Trainer.train_step` only once the process imports that module."""

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

FOLDER = os.environ.get("DISTLM_TEST_PROCESS")
_first_step: list[float] = []


def _write() -> None:
    record = {
        "argv": sys.argv,
        "modules": sorted(sys.modules),
        "first_step_cpu_s": _first_step[0] if _first_step else None,
        "exit_cpu_s": time.process_time(),
    }
    with open(os.path.join(FOLDER, f"{os.getpid()}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)


class _WatchTrainer(importlib.abc.MetaPathFinder):
    """Once distlm.train.trainer is loaded, its Trainer.train_step notes the CPU seconds of the
    process when the first step starts."""

    def find_spec(self, name, path, target=None):
        if name != "distlm.train.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            step = module.Trainer.train_step

            def train_step(self):
                if not _first_step:
                    _first_step.append(time.process_time())
                return step(self)

            module.Trainer.train_step = train_step

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if FOLDER:
    atexit.register(_write)
    sys.meta_path.insert(0, _WatchTrainer())

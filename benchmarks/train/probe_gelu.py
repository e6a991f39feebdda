"""GPT-2's MLP input projection and its tanh GELU, each way torch offers it on the CPU, timed.

    python benchmarks/train/probe_gelu.py                  # 1 thread, rows 1 16 64 1024
    python benchmarks/train/probe_gelu.py --width 768 --rows 1024

For `c_fc` (width -> 4 x width) on `rows` tokens, with the heap settings the training ranks use
(`distlm.device.keep_freed_memory`), the best of five rounds of:

- `addmm`: the projection alone;
- `+ torch gelu(tanh)`: it and torch's tanh GELU kernel (what training runs);
- `+ gelu_new_`: it and the serving engine's four-operation GELU
  (`distlm.family.gpt2.blocks`);
- `oneDNN fused`: `torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "tanh")`, the
  projection with oneDNN's GELU as its post-op (what inductor's CPU fusion emits); it gives the
  activation only, not the pre-activation a backward pass needs;
- with `--cpp`, `+ C++ loop`: the hand-written forward of `gelu_cpp.py` (an experiment), and a
  second table of the GELU's forward and backward alone: torch's kernels against the C++ loops.

Prints a table in microseconds and the largest difference of each from torch's float64 result.
A diagnostic for docs/performance.md ("Training"), not a benchmark of a stage.
"""

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from distlm.device import keep_freed_memory
from distlm.family.gpt2.blocks import gelu_new_

parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
parser.add_argument("--width", type=int, default=128, help="model width (the default's: 128)")
parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 1024], help="tokens")
parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a rank's: 1)")
parser.add_argument("--cpp", action="store_true", help="add gelu_cpp.py's C++ loops (compiles)")
args = parser.parse_args()

torch.set_num_threads(args.threads)
keep_freed_memory("probe_gelu")
torch.manual_seed(0)
C = args.width
w = torch.randn(C, 4 * C) / math.sqrt(C)  # Conv1D's layout (in, out): pre-activations ~ N(0, 1)
b = torch.randn(4 * C) * 0.02
w_out_in = w.t().contiguous()  # a linear layer's (out, in), which oneDNN's op takes
fused = torch.ops.mkldnn._linear_pointwise


def best_us(f: Callable[[], torch.Tensor], rows: int) -> float:
    n = max(20, 200_000 // (rows * C))
    for _ in range(10):
        f()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return min(rounds)


ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "addmm": lambda x: torch.addmm(b, x, w),
    "+ torch gelu(tanh)": lambda x: F.gelu(torch.addmm(b, x, w), approximate="tanh"),
    "+ gelu_new_": lambda x: gelu_new_(torch.addmm(b, x, w)),
    "oneDNN fused": lambda x: fused(x, w_out_in, b, "gelu", [], "tanh"),
}
if args.cpp:
    import gelu_cpp  # beside this script

    cpp = gelu_cpp.extension()
    ways["+ C++ loop"] = lambda x: cpp.forward(torch.addmm(b, x, w))
print(f"width {C}, {args.threads} thread(s), torch {torch.__version__}; microseconds a call")
print("| rows | " + " | ".join(ways) + " |")
print("| --- |" + " --- |" * len(ways))
errors: dict[str, float] = {}
for rows in args.rows:
    x = torch.randn(rows, C)
    ref = F.gelu(torch.addmm(b.double(), x.double(), w.double()), approximate="tanh")
    for name, f in ways.items():
        if name != "addmm":
            err = (f(x).double() - ref).abs().max().item()
            errors[name] = max(errors.get(name, 0.0), err)
    cells = [f"{best_us(lambda f=f: f(x), rows):.1f}" for f in ways.values()]  # noqa: B023
    print(f"| {rows} | " + " | ".join(cells) + " |")
print("largest difference from float64:", {k: f"{v:.2e}" for k, v in errors.items()})
if args.cpp:
    print("\nthe GELU alone, forward and backward (microseconds a call)")
    print("| rows | torch forward | C++ forward | torch backward | C++ backward |")
    print("| --- | --- | --- | --- | --- |")
    worst = {"forward": 0.0, "backward": 0.0}
    for rows in args.rows:
        h = torch.addmm(b, torch.randn(rows, C), w)
        g = torch.randn_like(h)
        fwd: list[Callable[[], torch.Tensor]] = [
            lambda: F.gelu(h, approximate="tanh"),  # noqa: B023
            lambda: cpp.forward(h),  # noqa: B023
            lambda: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),  # noqa: B023
            lambda: cpp.backward(g, h),  # noqa: B023
        ]
        print(f"| {rows} | " + " | ".join(f"{best_us(f, rows):.1f}" for f in fwd) + " |")
        h64 = h.double().requires_grad_()
        y64 = F.gelu(h64, approximate="tanh")
        (d64,) = torch.autograd.grad(y64, h64, g.double())
        worst["forward"] = max(worst["forward"], (cpp.forward(h).double() - y64).abs().max().item())
        worst["backward"] = max(
            worst["backward"], (cpp.backward(g, h).double() - d64).abs().max().item()
        )
    print("C++ loops, largest difference from float64:", {k: f"{v:.2e}" for k, v in worst.items()})

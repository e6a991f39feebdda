"""An experiment for docs/performance.md, not part of distlm: GPT-2's tanh GELU, forward and
backward, each as one C++ loop over the elements, compiled on first use.

torch 2.13's CPU kernel for the tanh GELU runs at ~2 ns an element, five times its erf GELU; every
maintained route was measured and gains nothing in the training stage (docs/performance.md,
"Training"). This module measures what a hand-written kernel would give instead: a plain loop
that GCC vectorizes with glibc's vector `tanhf` (libmvec; `-O3 -march=native -ffast-math`).
`python benchmarks/train/gelu_cpp.py` builds it and checks it against torch's kernels;
`probe_gelu.py --cpp` times it alone (the stage was trained with it by `probe_phases.py`, a
diagnostic since removed: the stage's own profile now times a step's phases). It needs a C++ compiler and ninja (`torch.utils.cpp_extension.load_inline`; ~25 s
to build, cached by torch under TORCH_EXTENSIONS_DIR), which is why the stage does not use it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>

static constexpr float K = 0.7978845608028654f;  // sqrt(2 / pi)
static constexpr float C = 0.044715f;

static void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32,
              name, ": a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

torch::Tensor forward(torch::Tensor x) {
  check(x, "x");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const float* a = xc.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t n = xc.numel();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = a[i];
    out[i] = 0.5f * v * (1.f + std::tanh(K * v * (1.f + C * v * v)));
  }
  return y;
}

torch::Tensor backward(torch::Tensor grad, torch::Tensor x) {
  check(grad, "grad");
  check(x, "x");
  TORCH_CHECK(grad.sizes() == x.sizes(), "grad and x differ in shape");
  auto xc = x.contiguous();
  auto gc = grad.contiguous();
  auto dx = torch::empty_like(xc);
  const float* a = xc.data_ptr<float>();
  const float* g = gc.data_ptr<float>();
  float* out = dx.data_ptr<float>();
  const int64_t n = xc.numel();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = a[i], v2 = v * v;
    const float t = std::tanh(K * v * (1.f + C * v2));
    out[i] = g[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * K * (1.f + 3.f * C * v2));
  }
  return dx;
}
"""


@cache
def extension() -> Any:
    """The compiled module (built once per machine, then loaded from torch's cache)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "distlm_experiment_gelu_tanh",
        cpp_sources=_SOURCE,
        functions=["forward", "backward"],
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"],
    )


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return extension().forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return extension().backward(grad, x)


class GeluTanh(torch.nn.Module):
    """A drop-in for `torch.nn.GELU(approximate="tanh")` on float32 CPU tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GeluTanh.apply(x)


def swap_into(model: torch.nn.Module) -> int:
    """Replace the tanh GELU modules that `train.fast_kernels` put in `model`; how many."""
    n = 0
    for module in model.modules():
        act = getattr(module, "act", None)
        if isinstance(act, torch.nn.GELU) and act.approximate == "tanh":
            module.act = GeluTanh()
            n += 1
    return n


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Build the experiment's C++ GELU (torch's extension cache) and check it "
        "against torch's tanh GELU, forward and backward."
    )
    parser.parse_args()
    x = torch.randn(1024, 512)
    g = torch.randn_like(x)
    ext = extension()
    y = torch.nn.functional.gelu(x, approximate="tanh")
    d = torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    print(
        "largest difference from torch's kernels: forward "
        f"{(ext.forward(x) - y).abs().max().item():.2e}, backward "
        f"{(ext.backward(g, x) - d).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()

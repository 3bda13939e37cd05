"""When the decode kernels launch as programmatic dependents (Hopper with a Triton that has grid
dependency control), and that a Triton without it still runs them, launched as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastgen.kernels.programmatic_launch import launch_options, programmatic_launch

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]

OLD_TRITON = """
import sys, types
import triton.language.extra.cuda as real
fake = types.ModuleType("triton.language.extra.cuda")
fake.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("gdc")})
sys.modules["triton.language.extra.cuda"] = fake  # as Triton < 3.4 has it
import torch, torch.nn.functional as F
from fastgen.kernels import programmatic_launch
from fastgen.kernels.skinny_matmul import skinny_matmul
assert not programmatic_launch.GRID_DEPENDENCY_CONTROL
device = torch.device(sys.argv[1])
assert not programmatic_launch.programmatic_launch(device)
x, w = torch.randn(2, 64, device=device), torch.randn(24, 64, device=device)
torch.testing.assert_close(skinny_matmul(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
print("ok")
"""


def test_not_on_a_cpu_and_the_launch_keyword_only_when_on():
    assert not programmatic_launch(torch.device("cpu"))
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}


def test_a_triton_without_grid_dependency_control_runs_the_kernels_as_before():
    # Compiled on a GPU, where the launch keyword would otherwise be passed; under the interpreter
    # on a CPU. (Triton 3.6's interpreter cannot run a loop to a runtime bound with numpy 2.4+,
    # which is what the GPU machine has, so the GPU does not fall back to it.)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", OLD_TRITON, device], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]

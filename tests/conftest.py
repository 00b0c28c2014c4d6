import os

import torch

import llmsys  # noqa: F401  chooses compiled Triton or the interpreter before any test imports triton

# Fixture notebooks are graded by the tests, never collected by nbval themselves.
collect_ignore_glob = ["fixtures/*"]

# One thread per test process and per notebook kernel it starts (kernels inherit
# this environment): the tests use tiny tensors, where a second thread mostly
# waits, and two pytest-xdist workers with two threads each on two cores run
# several times slower than with one.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

import os

import llmsys  # noqa: F401  chooses compiled Triton or the interpreter before any test imports triton

# Fixture notebooks are graded by the tests, never collected by nbval themselves.
collect_ignore_glob = ["fixtures/*"]

# Under pytest-xdist each worker (and every notebook kernel it starts, which
# inherits this environment) gets one thread: two workers with two threads
# each on two cores run several times slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

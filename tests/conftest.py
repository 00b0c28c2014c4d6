import os

# Fixture notebooks are graded by the tests, never collected by nbval themselves.
collect_ignore_glob = ["fixtures/*"]

# Tests never touch the reader's own cache: each run gets its own unless told otherwise.
os.environ.setdefault("LLMSYS_TEST", "1")

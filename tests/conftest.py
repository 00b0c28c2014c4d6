# Fixture notebooks are graded by the tests, never collected by nbval themselves.
collect_ignore_glob = ["fixtures/*"]

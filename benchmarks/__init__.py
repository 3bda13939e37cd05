"""pytest-benchmark suites (own rootdir: pytest.ini); see docs/perf-ci.md."""

"""The `fastgen` command line: `bench throughput`, `bench latency` and `generate`."""

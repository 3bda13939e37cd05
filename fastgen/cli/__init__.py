"""The `fastgen` command line: `generate`, `serve` and `bench throughput|latency|serve|compare` (listed in `main`)."""

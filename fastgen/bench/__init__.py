"""What `fastgen bench` measures with: the synthetic workload (`workload`), the machine and
engine a run describes (`environment`), latency statistics (`stats`) and the versioned report
(`report`). The commands themselves are in `fastgen.cli`."""

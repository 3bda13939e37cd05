"""What `fastgen bench` measures, and how: offline throughput (`throughput`), one batch's
latency (`latency`) and a server under load (`serve_load`, one request at a time through
`serve_client`); the synthetic workload (`workload`), driving the engine (`runner`), the same
workload through another library (`peers`), the machine and engine a run describes
(`environment`), latency statistics (`stats`), the versioned report (`report`) and two reports
compared (`compare`). The command lines that call these are in `fastgen.cli`."""

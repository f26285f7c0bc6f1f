"""Load testing: workload-driven client, runner, sweep, capacity answers, reports, mock server."""

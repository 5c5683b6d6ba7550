"""Traffic generators: locust workloads and the soak."""

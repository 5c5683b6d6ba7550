"""Benchmarks through a running Serve app: serving, SLA tiers, batch jobs, co-location, sweeps."""

"""Test infrastructure shared by tests and benchmarks: a local Ray cluster,
fake engines, the Serve harness and engine helpers. Never imported by serving."""

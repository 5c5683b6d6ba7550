"""Engine benchmarks: throughput, latency, quantization, speculation, prefill, peers."""

"""Serving: KServe v2 (Triton REST, with binary tensors) and v1, dynamic batching, Prometheus metrics."""

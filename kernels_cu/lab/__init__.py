"""Developer tools: micro-benchmarks, probes and A/B drivers (`python -m kernels_cu.lab.NAME`); no product module imports them."""

"""KV page movers (imported as ``sglang_tiered.kernels``)."""

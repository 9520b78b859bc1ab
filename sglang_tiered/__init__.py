"""sglang-tiered: a tiered, admission-controlled prefix cache backend for SGLang.

Layers (imports go downward only):
  integration/  the only package that imports sglang (TieredRadixCache, plugin registration)
  core/         pure Python: cache identity, frequency sketch, admission policy
  kernels/      (``sglang_tiered.kernels``) torch/Triton KV page movers
"""

__version__ = "0.1.0"
SUPPORTED_SGLANG_VERSION = "0.5.23"

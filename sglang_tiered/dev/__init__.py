"""Development helpers: never imported by the runtime (the server, the plugin, the tiers).

| module | what |
|---|---|
| ``tiny_model.py`` | the built-in tiny model (random Llama, GQA 8q/4kv, BPE tokenizer trained locally) |
| ``server.py`` | start / wait for / stop CPU SGLang server processes (tests, benchmarks, ``serve``) |
| ``simulate.py`` | a simulated page allocator and request driver (``TieredRadixCache.create_simulated``) |
| ``workloads.py`` | the Mooncake trace loader and the multi-tenant generator (benchmarks, tests) |
| ``workload_family.py`` | the seeded family of generated workloads (bench/workload_family.py) |

tests/test_layering.py checks that nothing outside ``dev/`` imports it, except
``TieredRadixCache.create_simulated`` (lazily, like SGLang's own ``RadixCache.create_simulated``)
and the command line's development commands (``build-model``, ``serve``).
"""

"""The start-up measurements must not draw from SGLang's sampling RNG (the default generator,
seeded by --random-seed before the cache is built)."""
import torch

from sglang_tiered.integration.host_setup import measure_copy_gbps, measure_flops


def test_startup_measurement_leaves_the_default_rng_alone():
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    measure_flops(torch.device("cpu"), torch.float32, n=64, reps=1)
    measure_copy_gbps(torch.device("cpu"), nbytes=1 << 16, reps=1)
    assert torch.equal(torch.rand(4), want)

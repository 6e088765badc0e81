"""The mHC kernels' block configurations: the rows `python -m scripts.bench_kernels mhc --sweep` times (the first
of each kernel is its default at n=4) and each kernel's default launch on a GPU; scripts.kernel_resources compiles
the same rows. The times of the rows measured and dropped: docs/kernels.md."""
from __future__ import annotations

import torch

SWEEP = {  # kernel -> block configurations tried by --sweep (the first is the default)
    # The first row of each kernel is its default (kernels/mhc_fwd.py and kernels/mhc_bwd.py pick some per n);
    # the variants measured and dropped, with their times, are in docs/kernels.md.
    "coef_premix": [dict(BT=32, BC=128, num_warps=4), dict(BT=16, BC=128, num_warps=4),
                    dict(BT=32, BC=64, num_warps=4, APPLY_PASS=True), dict(BT=16, BC=64, num_warps=4),
                    dict(BT=32, BC=64, num_warps=4), dict(BT=16, BC=32, num_warps=2),
                    dict(BT=16, BC=64, num_warps=4, APPLY_PASS=True), dict(BT=16, BC=64, num_warps=2),
                    dict(BT=32, BC=64, num_warps=4, APPLY_PASS=True, ZIGZAG=False),
                    dict(BT=16, BC=256, num_warps=4)],
    "coef_premix_pre": [dict(BT=64, BC=64, num_warps=4), dict(BT=32, BC=64, num_warps=4),
                        dict(BT=16, BC=64, num_warps=4), dict(BT=32, BC=128, num_warps=4),
                        dict(BT=16, BC=128, num_warps=4), dict(BT=32, BC=64, num_warps=8),
                        dict(BT=64, BC=64, num_warps=8), dict(BT=64, BC=32, num_warps=4)],
    "coef_bwd": [dict(BT=32, BC=128, num_warps=8), dict(BT=64, BC=128, num_warps=8), dict(BT=32, BC=256, num_warps=8),
                 dict(BT=16, BC=128, num_warps=4), dict(BT=64, BC=64, num_warps=4)],
    "stream_bwd": [dict(BT=32, BC=16, num_warps=2), dict(BT=16, BC=64, num_warps=4), dict(BT=64, BC=16, num_warps=4),
                   dict(BT=32, BC=16, num_warps=2, GP_SCRATCH=True), dict(BT=16, BC=64, num_warps=8, GP_SCRATCH=True),
                   dict(BT=16, BC=64, num_warps=4, GP_SCRATCH=True)],
    "dphi": [dict(BT=32, BK=128, num_warps=4), dict(BT=64, BK=128, num_warps=4), dict(BT=64, BK=256, num_warps=8),
             dict(BT=128, BK=64, num_warps=4), dict(BT=32, BK=128, num_warps=4, splits=66)],
}


def default_configs(n: int) -> dict[str, dict]:
    """Each swept kernel's default launch configuration on a GPU at this n, as its launcher picks it."""
    from kernels.mhc_bwd import coef_bwd_config, dphi_config, stream_bwd_config
    from kernels.mhc_fwd import fwd_config
    gpu = torch.device("cuda")
    return {"coef_premix": fwd_config(gpu, n), "coef_premix_pre": fwd_config(gpu, n, apply=False),
            "coef_bwd": coef_bwd_config(gpu),
            "stream_bwd": stream_bwd_config(gpu, n), "dphi": dphi_config(gpu)}


def default_blocks(n: int) -> dict[str, dict]:
    """default_configs without coef_bwd's TOKENS (its second kernel's program size, which SWEEP does not vary)."""
    return {name: {k: v for k, v in cfg.items() if k != "TOKENS"} for name, cfg in default_configs(n).items()}

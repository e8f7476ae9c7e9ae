"""The planner (xmoe.plan.memory.estimate_memory) against one simulated rank of the same layout
(xmoe.train.simulate.measure_rank: real shards, kernels and allocations in torch's fake process group): within 10%
of the measured peak on CPU (fp32, torch kernels), for layouts whose peaks fall in different places."""

import pytest

from xmoe.config import ModelConfig, MoEConfig, ParallelConfig
from xmoe.plan.memory import estimate_memory
from xmoe.train.simulate import measure_rank

# every term of a size that counts: the head (V x H) as large as a layer's experts, 16 experts, top-4
CFG = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    max_seq_len=128,
    moe=MoEConfig(
        hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, aux_loss_coef=0.01, kernel_backend="torch"
    ),
)


@pytest.mark.parametrize(
    "layout,recompute",
    [
        (dict(dp=4, ep=4, tp=1), "none"),  # FSDP2: 4 experts per EP rank, one per dp rank (dim 0)
        (dict(dp=4, ep=16, tp=1), "full"),  # one expert per EP rank, split over dp on its hidden dim; full recompute
        (dict(dp=2, ep=4, tp=2), "moe"),  # TP with SSMB, MoE blocks recomputed
        (dict(dp=4, ep=1, tp=1), "none"),  # DDP replicas
    ],
)
def test_planner_within_ten_percent_of_a_simulated_rank(layout: dict, recompute: str) -> None:
    par = ParallelConfig(**layout, gpus_per_node=8)
    measured = measure_rank(CFG, par, micro_batch=1, seq_len=128, recompute=recompute, device="cpu")
    planned = estimate_memory(
        CFG, par, micro_batch=1, seq_len=128, recompute=recompute, kernel="torch", precision="fp32"
    )
    assert measured.measured_peak_bytes == pytest.approx(planned.peak, rel=0.10), planned.peak_at
    assert sum(planned.tracker_parts().values()) == pytest.approx(planned.peak)

"""Parallelism styles the planner finds by itself, asserted on the plan."""
import torch

import autopar


def test_llama_long_sequence_uses_sequence_parallelism():
    """At 16k tokens the RMSNorm regions are split on the sequence dim and the
    tensor-parallel all-reduces become reduce-scatter + all-gather pairs
    (Korthikanti et al. 2022)."""
    from llama import Llama, LlamaConfig, lm_loss
    cfg = LlamaConfig(vocab=32000, seq=16384, hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=2)
    with torch.device("meta"):
        model = Llama(cfg)
        idx = torch.randint(0, cfg.vocab, (1, cfg.seq))
    plan = autopar.compile(model, (idx, idx), mesh=8, cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    norms = [n for n in plan.nodes if n.location.endswith("_norm") and n.op == "rsqrt"]
    assert norms and all(n.output_spec == "S(1)" for n in norms)
    forward = {c["kind"] for c in plan.collectives if c["phase"] == "forward"}
    assert {"reduce_scatter", "all_gather"} <= forward


def test_moe_many_experts_small_batch_is_expert_parallel_with_all_to_all():
    """64 experts, batch 64 of 256 tokens, 4 devices: each device keeps 16
    experts, and the batch-split tokens reach their experts' slots by all-to-all."""
    from moe import MoEConfig, MoETransformer, lm_loss
    cfg = MoEConfig(vocab=4096, seq=256, hidden=256, heads=8, kv_heads=4, ffn=1024, experts=64, layers=2,
                    grouped=True)
    with torch.device("meta"):
        model = MoETransformer(cfg)
        idx = torch.randint(0, cfg.vocab, (64, cfg.seq))
    plan = autopar.compile(model, (idx, idx), mesh=4, cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    for layer in (0, 1):
        for w in ("w1", "w2", "w3"):
            assert plan.parameters[f"blocks.{layer}.ffn.{w}"]["placements"] == ["S(0)"]
    moe_all_to_all = [c for c in plan.collectives
                      if c["kind"] == "all_to_all" and ".ffn" in plan.node(c["node"]).location]
    assert {c["phase"] for c in moe_all_to_all} == {"forward", "backward"}

"""How the plan moves as the per-device memory budget shrinks.

    python benchmarks/budget_sweep.py

A GPT (hidden 512, 4 layers, batch 8 x 128 tokens, bf16 mixed-precision
AdamW) on four A100 nodes of one GPU each (data parallelism crosses nodes),
compiled at budgets from unlimited down to below the smallest plan. Prints
the step time, the peak, how parameters are held and the recomputation; the
last line is the InfeasibleError's figure (tests/test_memory.py asserts the
same sweep).
"""
import collections
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import autopar  # noqa: E402
from autopar.cost_models.cluster import get_cluster  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

LABELS = {0: "DP", 2: "ZeRO-2", 3: "ZeRO-3", None: "TP"}


def main(budgets_mb=(None, 150, 120, 90, 75, 72, 70, 60)):
    cfg = GPTConfig(vocab=1024, seq=128, hidden=512, heads=8, layers=4)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab, (8, cfg.seq))
    cluster = {**get_cluster("dgx-a100").to_json(), "name": "a100-one-per-node", "devices_per_node": 1}
    del cluster["host"]  # about ZeRO's stages, as tests/test_memory.py's sweep (offload: tests/test_offload.py)
    print(f"{'budget':>8} {'step':>9} {'peak':>9}  {'parameters held as (count)':34} recompute")
    for mb in budgets_mb:
        try:
            plan = autopar.compile(model, (idx, idx), mesh=4, cluster=cluster, loss_fn=lm_loss, precision="bf16",
                                   memory=mb and mb * 1e6, pipeline_stages=1, time_limit_s=120)
        except autopar.InfeasibleError as e:
            print(f"{mb:>5} MB  InfeasibleError: the smallest plan needs {e.needed_bytes / 1e6:.1f} MB")
            continue
        held = collections.Counter(LABELS[p["zero_stage"]] for p in plan.parameters.values())
        text = ", ".join(f"{k} {v}" for k, v in sorted(held.items()))
        print(f"{(str(mb) + ' MB') if mb else 'none':>8} {plan.solver['objective'] * 1e3:6.3f} ms "
              f"{plan.predicted['peak_memory_bytes'] / 1e6:6.1f} MB  {text:34} {plan.recompute['mode']}")


if __name__ == "__main__":
    main()

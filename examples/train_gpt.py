"""Train the example GPT with autopar, the way a user would.

    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh 2x2 --cluster cpu

Every rank builds the same model (same seed), ``autoparallelize`` plans it and
shards it; the loop below is ordinary PyTorch. ``--local-inputs`` feeds each
rank only its shard of the batch, as a DistributedSampler would.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autopar  # noqa: E402
from gpt import small  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", help="write a full (unsharded) state_dict here")
    ap.add_argument("--load", help="start from this full state_dict")
    args = ap.parse_args()

    model, (idx, target), loss_fn = small()
    if args.load:
        model.load_state_dict(torch.load(args.load))
    pmodel = autopar.autoparallelize(model, (idx, target), loss_fn=loss_fn, mesh=args.mesh, cluster=args.cluster)
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-3)
    for step in range(args.steps):
        loss = pmodel(idx, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    state = pmodel.state_dict()  # full tensors, original names, on every rank
    if args.save and dist.get_rank() == 0:
        torch.save(state, args.save)
    autopar.shutdown(exit_code=0)  # every rank leaves together, after rank 0 has saved


if __name__ == "__main__":
    main()

"""dsc with torchrun and DDP: torchrun --nproc_per_node 2 examples/frameworks/torchrun_train.py DATA [--resume FILE]

The loader takes rank and world size from torch.distributed when an epoch starts, so it may be
made before `init_process_group`. Rank 0 saves `loader.state_dict()` with the model; every rank
loads it, also on another number of processes: the rest of the epoch is split among them.
"""

import os

import torch
import torch.distributed as dist
from common import loss_of, options, record_served, small_net
from torch.nn.parallel import DistributedDataParallel

from dsc import MemmapDataset


def main() -> None:
    args = options(__doc__)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    ds = MemmapDataset(args.data)
    loader = ds.loader(args.batch_size, order="random", seed=0, device=device if device.type == "cuda" else None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    net = DistributedDataParallel(small_net(len(ds.classes)).to(device))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    step = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
        net.module.load_state_dict(checkpoint["net"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
        step = checkpoint["step"]
    for epoch in range(loader.epoch, args.epochs):  # after load_state_dict, loader.epoch is the epoch to finish
        for batch in loader:
            record_served(args.record, dist.get_rank(), epoch, step, batch)
            loss_of(net, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.every == 0 and dist.get_rank() == 0:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                torch.save({"net": net.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict(), "step": step}, f"{args.checkpoint_dir}/step={step}.pt")
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    del net  # before the group: DDP dropping the last reference to a gloo group can deadlock at exit (torch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""dsc with Accelerate: accelerate launch --num_processes 2 examples/frameworks/accelerate_train.py DATA [--resume DIR]

Leave the loader out of `prepare` (Accelerate wraps only torch DataLoaders; a dsc loader splits
the data between ranks itself) and register it for checkpointing: `save_state` then saves its
position, and `load_state` makes it continue from there, on every rank. Do not wrap it in
`skip_first_batches`, which rebuilds a torch DataLoader.
"""

import torch
from accelerate import Accelerator
from common import Steps, loss_of, options, record_served, small_net

from dsc import MemmapDataset


def main() -> None:
    args = options(__doc__)
    accelerator = Accelerator()
    ds = MemmapDataset(args.data)
    device = accelerator.device if accelerator.device.type == "cuda" else None  # on a GPU the loader uploads
    loader = ds.loader(args.batch_size, order="random", seed=0, device=device)
    net = small_net(len(ds.classes))
    net, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    steps = Steps()
    accelerator.register_for_checkpointing(loader, steps)
    if args.resume:
        accelerator.load_state(args.resume)
    for epoch in range(loader.epoch, args.epochs):  # after load_state, loader.epoch is the epoch to finish
        for batch in loader:
            record_served(args.record, accelerator.process_index, epoch, steps.done, batch)
            accelerator.backward(loss_of(net, batch))
            optimizer.step()
            optimizer.zero_grad()
            steps.done += 1
            if steps.done % args.every == 0:
                accelerator.save_state(f"{args.checkpoint_dir}/step={steps.done}")
            if steps.done == args.max_steps:
                break
        if steps.done == args.max_steps:
            break
    net, optimizer = accelerator.free_memory(net, optimizer)  # the DDP model before the group (torchrun_train.py)
    accelerator.end_training()  # ends the process group before the interpreter does


if __name__ == "__main__":
    main()

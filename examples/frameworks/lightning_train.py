"""dsc with Lightning: python examples/frameworks/lightning_train.py DATA [--devices 2] [--resume CKPT]

Make the loader in `train_dataloader`: Lightning calls it once the process group is up and
the module sits on its device. Lightning saves the loader's state_dict() in every checkpoint
and loads it on every rank when it resumes; epochs advance by themselves.
"""

import lightning as L
import torch
from common import loss_of, options, record_served, small_net
from lightning.pytorch.callbacks import ModelCheckpoint

from dsc import MemmapDataset


class Classifier(L.LightningModule):
    def __init__(self, data: str, batch_size: int, record: str | None = None) -> None:
        super().__init__()
        self.data, self.batch_size, self.record = data, batch_size, record
        self.net = small_net(len(MemmapDataset(data).classes))

    def train_dataloader(self):
        device = self.device if self.device.type == "cuda" else None  # on a GPU the loader uploads the batches
        return MemmapDataset(self.data).loader(self.batch_size, order="random", seed=0, device=device)

    def training_step(self, batch, batch_idx):
        record_served(self.record, self.global_rank, self.current_epoch, self.global_step, batch)
        return loss_of(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    args = options(__doc__)
    checkpoints = ModelCheckpoint(args.checkpoint_dir, filename="{step}", every_n_train_steps=args.every,
                                  save_top_k=-1)
    trainer = L.Trainer(max_epochs=args.epochs, max_steps=args.max_steps, devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto", callbacks=[checkpoints], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(args.data, args.batch_size, args.record), ckpt_path=args.resume)

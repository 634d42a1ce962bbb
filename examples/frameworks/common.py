"""What the framework examples share: their options, a small network, and a log of what each rank trained on."""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn


def options(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("data", help="a compiled dsc dataset")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: run all epochs)")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--every", type=int, default=100, help="save a checkpoint every this many steps")
    parser.add_argument("--resume", help="a checkpoint to resume from")
    parser.add_argument("--devices", type=int, default=1, help="processes (Lightning only)")
    parser.add_argument("--record", help="append the indices each rank trained on to RECORD.rank<r> (JSON lines)")
    return parser.parse_args()


def small_net(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, classes))


def loss_of(net: nn.Module, batch) -> torch.Tensor:
    """uint8 images become floats on the device they were served to."""
    return nn.functional.cross_entropy(net(batch["image"].float().div_(255)), batch["label"])


def record_served(path: str | None, rank: int, epoch: int, step: int, batch) -> None:
    if path:
        with open(f"{path}.rank{rank}", "a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, "index": batch["index"].tolist()}) + "\n")


class Steps:
    """The global step, saved and loaded with the rest of a checkpoint (`state_dict` / `load_state_dict`)."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]

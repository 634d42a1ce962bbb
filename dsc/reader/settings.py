"""A loader's settings: checked once where the loader is made (`LoaderConfig`), and how the ones
bound later are resolved — the world and a bare "cuda" when a pass starts, a seed drawn from torch's
generator and agreed by every rank of a process group, the default order of a dataset stored sorted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsc.arguments import check_bool, check_int
from dsc.reader import order as orders
from dsc.reader import sampling as samplers
from dsc.reader.gather import default_threads


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) from the arguments, else from torch.distributed when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size, or neither")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device batches go to, or None for host batches ("cpu" means the same as None).

    Checked where the loader is made, so a device that is not there fails here, not at the first
    batch. A bare "cuda" stays bare: `bind_device` binds it when the first pass starts.
    """
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use 'cuda', 'cuda:N' or None") from None
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"the loader copies to CUDA devices only; got {str(device)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: no CUDA device is available here (torch.cuda.is_available() "
                         "is False); leave device unset for CPU batches")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def bind_device(device: torch.device | None) -> torch.device | None:
    """`device` with its index: a bare "cuda" is the current CUDA device of this thread. The loader binds
    its device when its first pass starts, as it takes the world then: a DDP script that makes its loader
    before `torch.cuda.set_device(local_rank)` gets its batches on its own GPU, not all on GPU 0."""
    if device is not None and device.index is None:
        return torch.device(device.type, torch.cuda.current_device())
    return device


def draw_seed() -> int:
    """A seed for a loader made without one, from torch's default generator, as `DataLoader(shuffle=True)`
    draws one: every new loader orders its epochs anew, and `torch.manual_seed` makes runs repeat."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def agreed_seed(seed: int, world_size: int) -> int:
    """Rank 0's `seed` on every rank (a broadcast over the process group): ranks that ordered an epoch with
    different seeds would serve overlapping shares. Without a process group of `world_size` ranks, refuse."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size):
        raise ValueError(f"{world_size} ranks and no seed: a seed drawn in each process would differ between "
                         "ranks (their shares would overlap), and there is no torch.distributed process group to "
                         "agree on one; give every rank the same seed=")
    box = [seed]
    dist.broadcast_object_list(box, src=0)
    return check_int("seed", box[0], 0)


def check_as_tuple(as_tuple: Any) -> tuple[str, ...] | None:
    """`as_tuple` as a tuple of field names (None: TensorDict batches); a bare string is refused, not spelt out."""
    if as_tuple is None:
        return None
    names = tuple(as_tuple) if isinstance(as_tuple, (tuple, list)) else ()
    if not names or not all(isinstance(name, str) for name in names):
        raise ValueError(f"as_tuple must be a tuple of field names, e.g. ('image', 'label'), got {as_tuple!r}")
    return names


def stored_sorted(manifest) -> bool:
    """Whether the records are stored in discovery order (compiled with shuffle off): for a folder, class after
    class, so contiguous records share a class and block order would give batches of one or two classes."""
    return manifest.compile.get("shuffle") is False


def sorted_block_warning(dataset, batch_size: int) -> str:
    """What block order does to a dataset stored sorted, with the figure: distinct classes per batch,
    against random order (estimated on epoch 0's first batches)."""
    figure = ""
    if len(dataset.classes) > 1:
        n, labels = len(dataset), dataset.opened.labels
        block, rand = (orders.mean_distinct(labels, orders.epoch_order(n, order, 0, 0), batch_size)
                       for order in ("block", "random"))
        figure = (f" ({block:.1f} distinct classes per batch of {batch_size} on average, against {rand:.1f} in "
                  f"random order, of {len(dataset.classes)})")
    return (f"{dataset.path} was compiled with shuffle off: its records are stored in discovery order (class "
            f"after class for a folder), so order='block' serves batches of few classes{figure}; use order='random' "
            "(the default for such a dataset) or recompile without --no-shuffle")


def order_for_shuffle(order: str | None, shuffle: bool | None, default: str = "block") -> str:
    """torch's spelling: `shuffle=True` is order "random", `shuffle=False` "sequential"; else `default`."""
    if shuffle is None:
        return default if order is None else order
    shuffle = check_bool("shuffle", shuffle, TypeError)
    wanted = "random" if shuffle else "sequential"
    if order is not None and (order == "sequential") == shuffle:
        raise ValueError(f"shuffle={shuffle} contradicts order={order!r}; give one of them (orders: "
                         f"sequential; block, shuffled within windows of contiguous blocks, the default; random)")
    return order or wanted


@dataclass(frozen=True)
class LoaderConfig:
    """What a loader serves, fixed when it is made. The plan, the sink (its buffers are sized for
    `batch_size`) and the producer thread (which runs ahead) all derive from it, so it cannot
    change under them: a loader's settings are read-only (`loader.seed = 7` raises); make a new
    loader, or resume one with another batch size through `load_state_dict`."""

    batch_size: int
    order: str
    seed: int | None  # as given; None: the loader draws one (`Loader.seed` is the one in use)
    drop_last: bool
    device: torch.device | None  # as given; a bare "cuda" is bound when the first pass starts (`Loader.device`)
    prefetch: int
    num_threads: int
    world: tuple[int | None, int | None]  # (rank, world_size) as given; None: from torch.distributed
    locality: str | None
    as_tuple: tuple[str, ...] | None = None  # field names: batches are tuples of these tensors
    sampling: samplers.Sampling | None = None  # indices, weights, repeats, samples_per_epoch, an order callable

    @classmethod
    def checked(cls, batch_size: int, *, order: Any, seed: int | None, drop_last: bool,
                device: str | torch.device | None, prefetch: int, num_threads: int | None, rank: int | None,
                world_size: int | None, locality: str | None, shuffle: bool | None,
                as_tuple: tuple[str, ...] | None = None, sorted_records: bool = False, records: int = 0,
                sampling: dict[str, Any] | None = None) -> LoaderConfig:
        """The configuration of these arguments, each checked: a bad one fails where the loader is made.
        Records stored sorted (`stored_sorted`) make "random" the default order, unless locality asks for blocks.
        `sampling`: the keyword arguments of `sampling.checked` (weights make "random" the default order)."""
        if callable(order) and shuffle is not None:
            raise ValueError("order= is a callable; shuffle= has nothing to add to it, leave it out")
        if not callable(order):
            drawn = (sampling or {}).get("replacement") is not None  # weighted draws are random by nature
            default = "random" if (sorted_records and locality is None) or drawn else "block"
            order = order_for_shuffle(order, shuffle, default)
        order, sampled = samplers.checked(records, order, locality=locality, **(sampling or {}))
        if (sampled is None or sampled.order_fn is None) and order not in orders.ORDERS:
            raise ValueError(f"order must be one of {orders.ORDERS}, got {order!r}")
        if sampled is None:
            orders.check_locality(order, locality)
        resolve_world(rank, world_size)  # bad explicit values fail here, not at the first epoch
        seed = None if seed is None else check_int("seed", seed, 0)
        return cls(check_int("batch_size", batch_size, 1), order, seed, check_bool("drop_last", drop_last),
                   resolve_device(device), check_int("prefetch", prefetch, 1),
                   default_threads() if num_threads is None else check_int("num_threads", num_threads, 1),
                   (rank, world_size), locality, check_as_tuple(as_tuple), sampled)

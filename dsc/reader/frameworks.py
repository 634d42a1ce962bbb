"""What a loader's pass tells a training framework that does not wrap it: where an epoch ends, for Accelerate.

`Accelerator.accumulate()` steps the optimizer every `gradient_accumulation_steps` batches and
also on a dataloader's last batch, then counts anew from the next epoch. It learns where that
is from `GradientState.end_of_dataloader`, which only loaders taking part in Accelerate's
`DataLoaderStateMixin` protocol set: its own prepared DataLoaders. `prepare()` returns a dsc
loader untouched (it wraps torch DataLoaders only), so an epoch's last batches used to be
accumulated with the next epoch's first ones (2 epochs of 25 batches, 3 steps: 16 optimizer
steps instead of 18). So each pass takes part itself, through that documented mixin and nothing
else of Accelerate's: `begin()` when the pass starts, `end_of_dataloader = True` as its last
batch is handed out, `end()` when it stops (exhausted, abandoned or replaced).

Accelerate is never imported here. A pass takes part only when the process has imported it
already (`accelerate.data_loader` is in `sys.modules`: the user uses it); otherwise, and with a
version without the mixin, `PassTracker` does nothing. Taking part costs one object per pass.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


@functools.cache
def _pass_state_class(mixin: type) -> type:
    """A `DataLoaderStateMixin` subclass for one pass (made once per Accelerate, the first time it is needed)."""

    class PassState(mixin):
        """One pass of a dsc loader as Accelerate's `GradientState` sees it (the mixin's own attributes).

        It gives no dataset length, so the mixin leaves `remainder` at -1: `gather_for_metrics`
        keeps every gathered sample, as it did before (a dsc loader's padding samples do not sit
        at the end of the last gathered batch, where Accelerate would cut them off).
        """

        def __init__(self, gradient_state: Any) -> None:
            self.gradient_state = gradient_state  # what the mixin's begin() and end() register with

    return PassState


def _accelerate_pass_state() -> Any | None:
    """A registered `PassState` when this process uses Accelerate, else None (Accelerate is not imported)."""
    module = sys.modules.get("accelerate.data_loader")
    mixin, gradient_state = getattr(module, "DataLoaderStateMixin", None), getattr(module, "GradientState", None)
    if mixin is None or gradient_state is None:
        return None
    state = _pass_state_class(mixin)(gradient_state())
    state.begin()  # end_of_dataloader = False; this pass becomes GradientState's active dataloader
    return state


class PassTracker:
    """Made when a pass starts: says when its last batch goes out (`last_batch`) and when it stops (`end`)."""

    def __init__(self) -> None:
        self._accelerate = _accelerate_pass_state()

    def last_batch(self) -> None:
        """The batch about to be handed out is the epoch's last: `accumulate()` will step the optimizer on it."""
        if self._accelerate is not None:
            self._accelerate.end_of_dataloader = True

    def end(self) -> None:
        """The pass is over: Accelerate's active dataloader is again whatever was active before it."""
        if self._accelerate is not None:
            self._accelerate.end()
            self._accelerate = None

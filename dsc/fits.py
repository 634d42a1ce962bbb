"""The records' fit (`dsc compile --fit`, the manifest's `compile.fit`) travelling with a batch to the transforms.

A transform's geometry assumes how the records were made from their sources: `OriginalCenterCrop`
and `RandomResizedCrop(original_sizes=True)` map boxes of the original image into a record that
holds the whole image stretched (`stretch`); `Resize` + `CenterCrop` assume the record kept the
source's aspect ratio (`center-crop`, `pad`). Paired with the other fit they silently give other
pixels (mean |diff| 18-20 per record against the right pairing's ~2), so they refuse it.

Transforms receive tensors (`batch["image"]`, `sizes=batch["size"]`), not the batch, so the
loader puts the fit on those two tensors of every batch it hands out, as a plain attribute
(`ATTRIBUTE`): it costs nothing per batch and follows the tensor object, also into an
`as_tuple` batch. A tensor made from them (`.cuda()`, `.float()`, another transform's output)
carries none; a transform then cannot tell the fit, and does not check.
"""

from __future__ import annotations

from typing import Any

ATTRIBUTE = "dsc_fit"
STRETCH = "stretch"
MARKED = ("image", "size")  # the batch fields that carry the fit


def mark(batch: Any, fit: str | None) -> None:
    """Put `fit` on the batch's image and size tensors (a loader batch, or any mapping of them)."""
    if fit is not None:
        for name in MARKED:
            setattr(batch[name], ATTRIBUTE, fit)


def of(*tensors: object) -> str | None:
    """The fit the first marked one of `tensors` carries; None when none is marked."""
    for tensor in tensors:
        fit = getattr(tensor, ATTRIBUTE, None)
        if fit is not None:
            return fit
    return None


def need_stretch(who: str, fit: str | None, instead: str) -> None:
    """Refuse records of a known fit other than stretch, for a transform that maps original-image boxes."""
    if fit is not None and fit != STRETCH:
        raise ValueError(f"{who} is for records compiled with --fit stretch (each source's whole image stretched "
                         f"to the record), but these were compiled with --fit {fit}: its boxes would land in the "
                         f"wrong place. For --fit {fit} records use {instead}")


def refuse_stretch(who: str, fit: str | None, allowed: bool, instead: str) -> None:
    """Refuse stretched records, for a transform that assumes each record kept its source's aspect ratio."""
    if fit == STRETCH and not allowed:
        raise ValueError(f"{who} keeps the records' aspect ratio as if it were the sources', but these records "
                         "were compiled with --fit stretch, not --fit center-crop or pad: each source was squeezed "
                         f"to the record's shape, so the result is distorted. Use {instead}; or pass "
                         "allow_stretched=True to keep the squeezed view on purpose")

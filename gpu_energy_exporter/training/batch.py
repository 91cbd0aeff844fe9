"""Counting the samples and tokens of a batch.

Used by the Lightning callback (which sees each batch), by the Hugging Face callback (through a forward
pre-hook on the model) and available to plain loops.

``count_batch`` reads shapes and dtypes only: its tokens are the elements of the token-id tensor,
padding included (what the model computes on, hence what FLOPs are counted from).

``count_tokens(batch, padding=False)`` counts the tokens that are not padding, from the batch's
``attention_mask``: in unpacked fine-tuning 20-50% of the positions are padding, and J/token computed from
padded counts is understated by that fraction. Reading the mask's values on the host would force a device
synchronisation on every step, the kind of cost the helper must never add, so the count is returned as
the 0-d tensor ``attention_mask.sum()`` (a kernel launch, no synchronisation): pass it to
``run.step(tokens=...)`` as it is; the run keeps the total on the device and reads it at export time, in
the background. Without an attention mask the count falls back to the shape count (padding included).

A tensor counts as token ids when it is a 32- or 64-bit integer tensor with at least two dimensions
(batch, sequence); floating-point inputs (images, audio features) count samples only. uint8 is left out
on purpose: it is the usual dtype of raw images. This module never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("gpu_energy_exporter.training")

_TOKEN_DTYPES = ("int32", "int64")


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def main_tensor(batch: Any, input_key: str = "input_ids") -> Any | None:
    """The tensor whose first dimension is the batch: ``batch[input_key]`` in a mapping (an HF
    ``BatchEncoding`` is one), else the first tensor found (one level into tuples and dicts)."""
    if _is_tensor(batch):
        return batch
    if isinstance(batch, Mapping):
        if input_key in batch and _is_tensor(batch[input_key]):
            return batch[input_key]
        values: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for value in values:
        if _is_tensor(value):
            return value
    for value in values:
        if isinstance(value, (Mapping, list, tuple)):
            found = main_tensor(value, input_key)
            if found is not None:
                return found
    return None


def attention_mask(batch: Any, like: Any = None) -> Any | None:
    """``batch["attention_mask"]`` when the batch is a mapping holding one (shaped like ``like``, the
    token-id tensor, when given), else None."""
    if not isinstance(batch, Mapping):
        return None
    mask: Any = batch.get("attention_mask")
    if not _is_tensor(mask):
        return None
    if like is not None and tuple(mask.shape) != tuple(like.shape):
        return None  # not a per-token mask of these ids (4-D attention biases, packed layouts)
    return mask


def non_padding_tokens(mask: Any) -> Any:
    """The non-padding positions of an attention mask, as a 0-d integer tensor (no synchronisation)."""
    if not str(mask.dtype).endswith(("bool", "int8", "int16", "int32", "int64")):
        mask = mask.long()  # float masks: count in integers, so totals stay exact
    return mask.sum()


def count_tokens(batch: Any, padding: bool = False, input_key: str = "input_ids") -> Any:
    """Tokens of one batch: with ``padding=False`` the attention mask's non-padding positions, as a 0-d
    tensor (no device synchronisation; ``int()`` it only if you need the number now); with
    ``padding=True``, or when the batch has no attention mask, every position (an ``int``, from shapes)."""
    samples, tokens = count_batch(batch, input_key)
    if padding or not tokens:
        return tokens
    mask = attention_mask(batch, main_tensor(batch, input_key))
    return tokens if mask is None else non_padding_tokens(mask)


def number(value: Any) -> int | float:
    """A plain int or float from a number, a 0-d tensor or a numpy scalar (reading a device tensor
    synchronises with its device)."""
    if value.__class__ in (int, float):
        return value
    if hasattr(value, "detach"):
        value = value.detach()
    item = getattr(value, "item", None)
    out = item() if callable(item) else value
    return out if isinstance(out, (int, float)) else float(out)


def add_count(total: Any, value: Any) -> Any:
    """``total + value`` for ints and 0-d tensors, on the device when a tensor is involved (no
    synchronisation). Two tensors on different GPUs (``nn.DataParallel`` replicas) cannot be added there:
    then both are read, a synchronisation on that rare path only. Never raises: a value that is no count
    (None, a string) is ignored."""
    if value.__class__ is int and not value:
        return total
    if total.__class__ is int and not total and (value.__class__ in (int, float) or _is_tensor(value)):
        return value
    try:
        return total + value
    except Exception:  # noqa: BLE001 - devices that do not match, or not a count at all
        try:
            return number(total) + number(value)
        except Exception:  # noqa: BLE001
            log.debug("ignoring a token count of type %s", type(value).__name__, exc_info=True)
            return total


def count_batch(batch: Any, input_key: str = "input_ids") -> tuple[int, int]:
    """``(samples, tokens)`` of one batch (see the module docstring); ``(0, 0)`` when nothing looks
    like a batch."""
    tensor = main_tensor(batch, input_key)
    if tensor is None:
        return 0, 0
    shape = tuple(tensor.shape)
    if not shape:
        return 0, 0
    samples = int(shape[0])
    tokens = 0
    if len(shape) >= 2 and str(tensor.dtype).endswith(_TOKEN_DTYPES):
        tokens = 1
        for dim in shape:
            tokens *= int(dim)
    return samples, tokens

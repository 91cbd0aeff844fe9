"""Counting the samples and tokens of a batch from tensor shapes alone.

Used by the Lightning callback (which sees each batch), by the Hugging Face callback (through a forward
pre-hook on the model) and available to plain loops. Only shapes and dtypes are read: reading values
(``attention_mask.sum()``) would force a device synchronisation on every step, the kind of cost the
helper must never add. Tokens are therefore the elements of the token-id tensor, padding included.

A tensor counts as token ids when it is a 32- or 64-bit integer tensor with at least two dimensions
(batch, sequence); floating-point inputs (images, audio features) count samples only. uint8 is left out
on purpose: it is the usual dtype of raw images. This module never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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

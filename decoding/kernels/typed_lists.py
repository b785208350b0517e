"""numba typed lists of arrays, built by cached functions.

A `numba.typed.List` filled from Python compiles its own methods (`_make_list`, `_append`) for each item
type in every process, which is most of a second of each start; the same operations inside functions with
`cache=True` are compiled once and loaded from the kernel cache afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numba import njit
from numba.typed import List


@njit(cache=True)
def _list_of(first):  # type: ignore[no-untyped-def]
    items = List()
    items.append(first)
    return items


@njit(cache=True)
def _append(items, item):  # type: ignore[no-untyped-def]
    items.append(item)


def typed_list(arrays: Iterable[np.ndarray]) -> List:
    """A numba typed list of `arrays` (at least one), typed after the first as `List.append` types it."""
    items = None
    for array in arrays:
        if items is None:
            items = _list_of(array)
        else:
            _append(items, array)
    if items is None:
        raise ValueError("a typed list needs at least one array to take its type from")
    return items

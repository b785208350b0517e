"""The kernels' weight lists are numba typed lists built by cached functions: the same list `List.append`
builds, and a second process loads the functions from the kernel cache instead of compiling them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba.typed import List

from decoding.kernels.typed_lists import typed_list

REPO = Path(__file__).resolve().parent.parent


def test_the_list_holds_the_arrays_themselves_typed_as_list_append_types_them():
    readonly = np.arange(12, dtype=np.uint8).reshape(3, 4)
    readonly.flags.writeable = False
    arrays = [readonly, readonly[::-1].copy(), np.zeros((0, 4), np.uint8)]
    arrays[1].flags.writeable = False
    built = typed_list(arrays)
    appended = List()
    for array in arrays:
        appended.append(array)
    assert built._numba_type_ == appended._numba_type_ and len(built) == 3
    for item, array in zip(built, arrays, strict=True):
        assert item.ctypes.data == array.ctypes.data and item.shape == array.shape  # not copies


def test_no_arrays_is_an_error_not_an_untyped_list():
    with pytest.raises(ValueError, match="at least one array"):
        typed_list([])


_BUILD = """
import numpy as np
from decoding.kernels import typed_lists
typed_lists.typed_list([np.zeros((2, 3), np.uint8), np.ones((2, 3), np.uint8)])
stats = [typed_lists._list_of.stats, typed_lists._append.stats]
print(sum(sum(s.cache_hits.values()) for s in stats), sum(sum(s.cache_misses.values()) for s in stats))
"""


def test_a_second_process_loads_the_functions_from_the_kernel_cache(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _BUILD], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True, timeout=120).stdout.split() for _ in range(2)]  # fmt: skip
    assert runs == [["0", "2"], ["2", "0"]]

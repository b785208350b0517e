"""A loaded model: config, stored weights, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .tokenizer import Tokenizer
from .weights import ModelWeights, WeightMatrix


@dataclass(eq=False)
class Model:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    path: Path
    name: str
    _dense: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def dense_weight(self, matrix: WeightMatrix) -> np.ndarray:
        """float32 copy of a matrix, made once and kept (for the reference path and tests only)."""
        key = id(matrix)
        if key not in self._dense:
            self._dense[key] = matrix.dequantize()
        return self._dense[key]

"""Float matrices stored in panels of columns (dtypes f16p / bf16p, docs/format.md).

A matrix W (d, n) in panels is the array P (n/PANEL, d, PANEL) with P[b, i] = W[i, b*PANEL:
(b+1)*PANEL]. The decode matvec (kernels/float_ir) loads x[b*PANEL:(b+1)*PANEL] into registers
once per panel and streams the panel's d rows as one sequence; row-major, every 64 weights
read 256 bytes of x from L1 beside the stream, which cost ~10% of the streaming rate here.

The converter writes panels (to_panels); at load time nothing moves: `Panels` wraps the
mapped view with the matrix's logical shape, the way quant.QTensor wraps quantized values.
Numba kernels receive `Panels.p`, told apart from a row-major matrix by its extra dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .format import PANEL
from .kernels.packing import from_panels, to_panels

__all__ = ["PANEL", "Panels", "to_panels", "from_panels", "kernel_array"]


@dataclass(frozen=True)
class Panels:
    """A matrix (or stack of matrices) stored in panels: p (..., n/PANEL, d, PANEL), uint16 (f16)
    or int16 (bf16), a view of the mapping."""
    p: np.ndarray

    @property
    def shape(self) -> tuple:
        """Logical shape (..., d, n)."""
        return self.p.shape[:-3] + (self.p.shape[-2], self.p.shape[-3] * self.p.shape[-1])

    @property
    def dtype(self) -> np.dtype:
        return self.p.dtype

    @property
    def ndim(self) -> int:
        return self.p.ndim - 1

    @property
    def nbytes(self) -> int:
        return self.p.nbytes

    def __getitem__(self, e) -> "Panels":
        """One matrix of a stack (an int index on the leading axis)."""
        if self.p.ndim < 4:
            raise IndexError("a single panel matrix has no stack axis to index")
        return Panels(self.p[e])


def kernel_array(W):
    """What a Numba kernel takes for a float weight: the panel array of a Panels, else W itself."""
    return W.p if isinstance(W, Panels) else W

"""What every kernel module shares: the interpreter switch and exact rounding."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Read when a kernel is launched, but Triton itself decides at import whether `@triton.jit`
    interprets, so the variable must be set before quantpipe.kernels modules are imported.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def round_half_even(x):
    """torch.round's rounding (ties to even). libdevice's rint is not available in the interpreter."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)

"""GPTQ (Frantar et al., 2022): quantize a Linear's columns one at a time, pushing each
column's rounding error onto the columns not yet quantized through the inverse Hessian
of the layer's inputs, H = 2 X^T X / n.

Details that matter: dampening adds `dampening` x mean(diag H) to the diagonal (retried
10x larger when the Cholesky factorization fails); columns are processed in blocks with
a lazy update of the rest (in column order, blocks are whole groups, so a group's scale is
computed from its already-updated weights); act-order quantizes columns by decreasing
Hessian diagonal but keeps each column's group and scale of the original order (what
compressed-tensors calls actorder "weight": no g_idx, any kernel reads it).
"""

from __future__ import annotations

import torch

from quantpipe.quantize.rtn import WeightScheme, qparams


class HessianError(RuntimeError):
    pass


def inverse_hessian_cholesky(h: torch.Tensor, dampening: float, retries: int = 4) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of H^-1 after dampening; (factor, dampening actually used)."""
    mean_diag = torch.mean(torch.diag(h)).item()
    damp = dampening
    for _ in range(retries):
        hd = h.clone()
        hd.diagonal().add_(damp * mean_diag)
        try:
            low = torch.linalg.cholesky(hd)
            inv = torch.cholesky_inverse(low)
            return torch.linalg.cholesky(inv, upper=True), damp
        except torch.linalg.LinAlgError:
            damp *= 10
    raise HessianError(f"the Hessian is not positive definite even with dampening {damp / 10:g}")


def gptq(w: torch.Tensor, h: torch.Tensor, scheme: WeightScheme, dampening: float = 0.01, block_size: int = 128,
         act_order: bool = False, scale_dtype: torch.dtype = torch.float32, shrink: torch.Tensor | None = None):
    """(q int8 [N, K], scale [N, G], zero or None, dampening used) for weight w [N, K].

    `shrink` [N, G] narrows each group's range before its grid is fixed (a clipping search's
    result, e.g. `awq.search_clip`); None keeps min-max."""
    w = w.detach().float().clone()
    h = h.detach().double().clone()
    n, k = w.shape
    gs = scheme.group_size or k
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    # In column order a group's scale comes from its weights as updated so far, so a group must
    # not straddle two blocks: blocks of max(block_size, gs) columns, a multiple of gs when gs is
    # the smaller. Per-channel grids (gs = K, any K) and act-order (scales fixed up front) are free.
    if not act_order and gs < block_size and block_size % gs:
        raise ValueError(f"block_size {block_size} must be a multiple of group_size {gs}")

    # Scales (and zero points) of each group as rows [G, N].
    if act_order:
        # From the original weights, fixed before any column moves (static groups).
        scale, zero = qparams(w, scheme, 1.0 if shrink is None else shrink)
        scale_t, zero_t = scale.to(scale_dtype).float().t().contiguous(), None if zero is None else zero.t().contiguous()
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        # Filled as each group starts, from its weights as updated so far.
        scale_t, zero_t = torch.zeros(k // gs, n), None if scheme.symmetric else torch.zeros(k // gs, n)
        perm = torch.arange(k)
    inv_perm = torch.argsort(perm)
    # Transposed, [K, N]: the loop below walks the columns, and each is then a contiguous row.
    wt = w[:, perm].t().contiguous()
    h = h[perm][:, perm]
    hinv, used = inverse_hessian_cholesky(h, dampening)
    hinv = hinv.float()
    group_of = (perm // gs).tolist()  # original group of each (permuted) column
    q_out = torch.empty(k, n, dtype=torch.int8)
    step = max(block_size, gs) if not act_order else block_size
    per_group = WeightScheme(scheme.num_bits, None, scheme.symmetric)
    q_min, q_max = scheme.q_min, scheme.q_max
    qf = torch.empty(step, n)  # a block's grid values
    err1 = torch.empty(step, n)  # and its columns' errors, rows reused from block to block
    update = torch.empty(step, n)
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        w1 = wt[i1:i2].clone()
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not act_order and col % gs == 0:
                # The group's grid, from its weights as updated so far.
                g = col // gs
                s, z = qparams(w1[i:i + gs].t(), per_group, 1.0 if shrink is None else shrink[:, g:g + 1])
                scale_t[g] = s[:, 0].to(scale_dtype).float()
                if zero_t is not None:
                    zero_t[g] = z[:, 0]
            # One column onto its group's grid and back: rtn.quantize and QuantWeight.dequantize's
            # arithmetic, written out for a single column (this loop runs once per input feature),
            # into preallocated rows.
            g = group_of[col]
            s_row, z_row = scale_t[g], None if zero_t is None else zero_t[g]
            wc, qc, err = w1[i], qf[i], err1[i]
            torch.div(wc, s_row, out=qc)
            if z_row is not None:
                qc.add_(z_row)
            qc.round_().clamp_(q_min, q_max)
            if z_row is None:
                torch.mul(qc, s_row, out=err)
            else:
                torch.sub(qc, z_row, out=err).mul_(s_row)
            torch.sub(wc, err, out=err).div_(hinv1[i, i])
            rest = i2 - i1 - i - 1
            if rest:
                torch.mul(hinv1[i, i + 1:, None], err, out=update[:rest])
                w1[i + 1:].sub_(update[:rest])
        q_out[i1:i2] = qf[:i2 - i1]
        if i2 < k:
            wt[i2:] -= (err1[:i2 - i1].t() @ hinv[i1:i2, i2:]).t()
    return (q_out[inv_perm].t().contiguous(), scale_t.t().contiguous(),
            None if zero_t is None else zero_t.t().contiguous(), used)

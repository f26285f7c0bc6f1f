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
         act_order: bool = False, scale_dtype: torch.dtype = torch.float32, shrink: torch.Tensor | None = None,
         scale: torch.Tensor | None = None):
    """(q int8 [N, K], scale [N, G], zero or None, dampening used) for weight w [N, K].

    `shrink` [N, G] narrows each group's range before its grid is fixed (a clipping search's
    result, e.g. `awq.search_clip`); None keeps min-max. `scale` [N, G] fixes a symmetric
    grid's scales instead (`refit_scales`' result), static as with act-order."""
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
    static = act_order or scale is not None
    if scale is not None and not scheme.symmetric:
        raise ValueError("fixed scales are for symmetric grids")
    if not static and gs < block_size and block_size % gs:
        raise ValueError(f"block_size {block_size} must be a multiple of group_size {gs}")

    # Scales (and zero points) of each group as rows [G, N].
    if static:
        # From the original weights (or given), fixed before any column moves (static groups).
        if scale is None:
            scale, zero = qparams(w, scheme, 1.0 if shrink is None else shrink)
        else:
            zero = None
        scale_t, zero_t = scale.to(scale_dtype).float().t().contiguous(), None if zero is None else zero.t().contiguous()
        perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
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
    step = max(block_size, gs) if not static else block_size
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
            if not static and col % gs == 0:
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


def refit_scales(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric grids: each row's group scales, refitted by least squares for the codes GPTQ
    chose, minimizing the layer's output error (w - s q) H (w - s q)^T over the row's scales
    at once (groups are coupled through H). [N, G] float64; where a row's solve does not lower
    that error or flips a scale's sign (a group without a nonzero code, a singular system), the
    row keeps `scale`."""
    n, k = w.shape
    g = scale.shape[1]
    gs = k // g
    w, h, c = w.double(), h.double(), q.double()
    s0 = scale.double()
    # A[n] = C_n^T H C_n with C_n [K, G] the row's codes, one column per group; b[n] = C_n^T H w_n.
    u = torch.einsum("ihj,nhj->nih", h.view(k, g, gs), c.view(n, g, gs))  # [N, K, G]: H C_n
    a = torch.einsum("ngi,ngih->ngh", c.view(n, g, gs), u.view(n, g, gs, g))
    b = (c * (w @ h)).view(n, g, gs).sum(-1)
    ridge = 1e-9 * a.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-30)[:, None, None] * torch.eye(g, dtype=a.dtype)
    s = torch.linalg.solve(a + ridge, (b + (ridge @ s0[..., None])[..., 0])[..., None])[..., 0]

    def err(sc):
        d = w - (c.view(n, g, gs) * sc[..., None]).view(n, k)
        return ((d @ h) * d).sum(-1)

    better = torch.isfinite(s).all(-1) & (s * s0 > 0).all(-1) & (err(s) < err(s0))
    return torch.where(better[:, None], s, s0)


def fp_target(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor, dampening: float) -> torch.Tensor:
    """GPTAQ's asymmetric calibration as a GPTQ target: the weight W' whose outputs on the
    quantized model's inputs X come closest to the unquantized model's outputs X_fp W^T.
    With H = 2 X^T X / n and D = 2 (X_fp - X)^T X / n, W' = W + W D H^-1 (H dampened as GPTQ
    dampens it), so ||X_fp W^T - X Q^T|| = ||X W'^T - X Q^T|| + a constant: GPTQ on W'
    minimizes the error against the unquantized path, not against this layer alone."""
    hd = h.double().clone()
    dead = torch.diag(hd) == 0
    hd[dead, dead] = 1
    hd.diagonal().add_(dampening * torch.mean(torch.diag(hd)).item())
    low = torch.linalg.cholesky(hd)
    wd = w.double()
    # (W D) H^-1 = (H^-1 (W D)^T)^T, H symmetric
    return (wd + torch.cholesky_solve((wd @ d.double()).t(), low).t()).float()

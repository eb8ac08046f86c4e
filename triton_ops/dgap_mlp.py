"""Two small MLPs evaluated side by side, one launch per layer for both (DGAP's detector and corrector on the
feature row of every decode step).

An MLP here is `Linear (GELU Linear)*`: a list of `(weight [out, in], bias [out])` float32 pairs, GELU (exact, erf)
after every layer but the last; its input is a column range of a float32 row, normalized on load as
`(x - mean) / std`. Layer `l` of both MLPs runs in one kernel: each program computes `BJ` outputs of one row of one
MLP (grid: rows x output chunks of MLP a + output chunks of MLP b), so the weights are read by many programs at
once. Dot products are summed in another order than cuBLAS: results agree within float32 rounding.
"""

import torch
import triton
import triton.language as tl

from .device import on_device_of

BJ = 16  # outputs per program
BI = 128  # inputs per step of the dot products


@triton.jit
def _dense(x_ptr, x_stride, n_in, mean_ptr, std_ptr, w_ptr, b_ptr, y_ptr, n_out, row, chunk, NORM: tl.constexpr,
           GELU: tl.constexpr, BJ: tl.constexpr, BI: tl.constexpr):
    j = chunk * BJ + tl.arange(0, BJ)
    jm = j < n_out
    acc = tl.zeros([BJ, BI], tl.float32)
    for i0 in range(0, n_in, BI):
        i = i0 + tl.arange(0, BI)
        im = i < n_in
        x = tl.load(x_ptr + row * x_stride + i, mask=im, other=0.0)
        if NORM:
            x = (x - tl.load(mean_ptr + i, mask=im, other=0.0)) / tl.load(std_ptr + i, mask=im, other=1.0)
        w = tl.load(w_ptr + j[:, None] * n_in + i[None, :], mask=jm[:, None] & im[None, :], other=0.0)
        acc += w * x[None, :]
    y = tl.sum(acc, 1) + tl.load(b_ptr + j, mask=jm, other=0.0)
    if GELU:
        y = 0.5 * y * (1 + tl.math.erf(y * 0.7071067811865476))
    tl.store(y_ptr + row * n_out + j, y, mask=jm)


@triton.jit
def _dense_pair_kernel(xa_ptr, xa_stride, na_in, ma_ptr, sa_ptr, wa_ptr, ba_ptr, ya_ptr, na_out,
                       xb_ptr, xb_stride, nb_in, mb_ptr, sb_ptr, wb_ptr, bb_ptr, yb_ptr, nb_out, CHUNKS_A,
                       NORM_A: tl.constexpr, GELU_A: tl.constexpr, NORM_B: tl.constexpr, GELU_B: tl.constexpr,
                       BJ: tl.constexpr, BI: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    if c < CHUNKS_A:
        _dense(xa_ptr, xa_stride, na_in, ma_ptr, sa_ptr, wa_ptr, ba_ptr, ya_ptr, na_out, row, c, NORM_A, GELU_A, BJ,
               BI)
    else:
        _dense(xb_ptr, xb_stride, nb_in, mb_ptr, sb_ptr, wb_ptr, bb_ptr, yb_ptr, nb_out, row, c - CHUNKS_A, NORM_B,
               GELU_B, BJ, BI)


def _check(name, x, layers, norm):
    if not layers:
        raise ValueError(f"MLP {name} has no layers")
    width = x.shape[-1]
    for w, b in layers:
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise ValueError(f"MLP {name}: layer weight {tuple(w.shape)} {w.dtype} does not take {width} float32 "
                             f"inputs (or its bias {tuple(b.shape)} does not fit)")
        if not (w.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"MLP {name}: weights and biases must be contiguous")
        width = w.shape[0]
    if any(t.shape != (x.shape[-1],) for t in norm):
        raise ValueError(f"MLP {name}: normalization of {[tuple(t.shape) for t in norm]} for {x.shape[-1]} inputs")


def mlp_pair(xa: torch.Tensor, layers_a, norm_a, xb: torch.Tensor, layers_b, norm_b):
    """`(MLP a of xa, MLP b of xb)`, float32 `[N, out]` each. `xa`/`xb`: float32 `[N, in]` (column views of one row
    are fine: the last dim must be contiguous); `layers_*`: `[(weight, bias), ...]`; `norm_*`: `(mean [in], std
    [in])`, applied to the input on load. The shallower MLP's layers run with the deeper one's last ones."""
    _check("a", xa, layers_a, norm_a)
    _check("b", xb, layers_b, norm_b)
    if xa.stride(-1) != 1 or xb.stride(-1) != 1 or xa.shape[0] != xb.shape[0]:
        raise ValueError("both inputs need the same rows and a contiguous last dim")
    n = xa.shape[0]
    xs, mlps = [xa, xb], [(layers_a, norm_a), (layers_b, norm_b)]
    depth = max(len(layers_a), len(layers_b))
    with on_device_of(xa):
        for step in range(depth):
            jobs = []  # (x, weight, bias, y, mean, std, normalize, gelu) of the MLPs that have a layer at this step
            for m, (layers, norm) in enumerate(mlps):
                layer = step - (depth - len(layers))
                if layer < 0:
                    continue
                w, b = layers[layer]
                y = torch.empty(n, w.shape[0], dtype=torch.float32, device=xa.device)
                mean, std = norm if layer == 0 else (b, b)  # (b, b): not read past the first layer
                jobs.append((xs[m], w, b, y, mean, std, layer == 0, layer < len(layers) - 1))
                xs[m] = y
            chunks = [triton.cdiv(job[1].shape[0], BJ) for job in jobs] + [0]  # one job: the second gets no chunks
            (xa_, wa, ba, ya, ma, sa, na, ga), (xb_, wb, bb, yb, mb, sb, nb, gb) = (jobs * 2)[:2]
            _dense_pair_kernel[(n, chunks[0] + chunks[1])](
                xa_, xa_.stride(0), wa.shape[1], ma, sa, wa, ba, ya, wa.shape[0],
                xb_, xb_.stride(0), wb.shape[1], mb, sb, wb, bb, yb, wb.shape[0], chunks[0],
                NORM_A=na, GELU_A=ga, NORM_B=nb, GELU_B=gb, BJ=BJ, BI=BI, num_warps=4)
    return xs[0], xs[1]

"""The Triton sources of the paged attention kernel (see triton_paged.py for its contract) and
of the batch-invariant matmul (triton_matmul.py). Imported only when they are used; jitted
there, lazily, in the mode that TRITON_INTERPRET names at first use (`jit_for_mode`)."""

import types

import triton.language as tl


def jit_for_mode(kernel_fn, **jit_kwargs):
    """`kernel_fn` jitted in the mode TRITON_INTERPRET names now, with its helper `sum_dot`
    jitted in that same mode. Compiled Triton rejects a kernel that names a plain Python
    function, even in a branch a constexpr switches off (its dependency finder hashes every
    global a kernel reads: "Unsupported function referenced", seen on an H200 with triton
    3.6); the interpreter runs either. Each call gets its own copy of this module's globals,
    so an interpreted and a compiled kernel can live in one process (a GPU machine's test run
    has both)."""
    import triton
    namespace = dict(kernel_fn.__globals__)
    namespace["sum_dot"] = triton.jit(sum_dot)
    fn = types.FunctionType(kernel_fn.__code__, namespace, kernel_fn.__name__,
                            kernel_fn.__defaults__, kernel_fn.__closure__)
    fn.__module__, fn.__qualname__, fn.__doc__ = (
        kernel_fn.__module__, kernel_fn.__qualname__, kernel_fn.__doc__)
    # the tl.constexpr annotations say which parameters are compile-time constants (without
    # them an H200 refused tl.arange(0, BLOCK_M)); a new function object has none of its own
    fn.__annotations__ = dict(kernel_fn.__annotations__)
    fn.__kwdefaults__ = kernel_fn.__kwdefaults__
    return triton.jit(fn, **jit_kwargs)


def sum_dot(a, b):
    """a [M, K] @ b [K, N] as products summed over K (the interpreter's dot, SUM_DOT): each
    output element by the same numpy reduction whatever its row. The interpreter's tl.dot is
    numpy's BLAS matmul, whose bits for a row depend on its place in the tile (row 8 of 16
    differed from row 0 in float32, measured), which a GPU's dot does not do to
    batch-invariant mode's tests; kept off CUDA, where tl.dot runs."""
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        tile_seq_ptr, tile_start_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
        SUM_DOT: tl.constexpr = False):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len) & (token < tile_start + BLOCK_Q)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = ctx_before + token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_before + tile_start + BLOCK_Q)  # the tile's last key + 1
    for key_start in range(0, kv_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE,
                        mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_offs = (slot * KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if SUM_DOT:
            s = sum_dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allowed = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(allowed, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if SUM_DOT:
            acc = acc * alpha[:, None] + sum_dot(p, v.to(tl.float32))
        elif F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = (q_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def invariant_matmul_kernel(
        x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        F32_DOT: tl.constexpr, SUM_DOT: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T: one output tile per program, K in order from 0, one
    float32 accumulator (see triton_matmul.py for why every row's order is fixed)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_wn + kk[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if SUM_DOT:
            acc += sum_dot(x.to(tl.float32), w.to(tl.float32))
        elif F32_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

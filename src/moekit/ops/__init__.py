"""moekit's ops: one module per op (autograd Function, launchers, float64 reference), its Triton
kernels, jit code only, in a sibling module named `<op>_kernels.py`.

Shape legend of the whole package. Internal tensor names may carry their shape as a suffix
(`x_MI`, `w_NOI`, `row_map_TK`); each letter has this one meaning everywhere:

    N   groups: experts (or a grouped linear's GEMMs)
    M   routed rows, the rows of a grouped op: tokens x top-k after permute
    T   tokens
    K   top-k, experts per token (only that: never a GEMM dimension or a block size)
    I   a linear's in_features; the reduction dimension of a forward GEMM
    O   a linear's out_features
    H   hidden size (fc1's I, fc2's O)
    F   expert ffn size: fc1 maps H -> 2F (gate and up), fc2 maps F -> H

A GEMM's reduction dimension is named for what it is (I, M in a weight gradient) or `red`, never
"K". The GLU block size has no letter: `glu_interleave_size`. A literal 2 stays a number (`h_M2F`).
Public parameters and error messages use plain names (`bias_scale`, `in_features`), not these
suffixes.
"""

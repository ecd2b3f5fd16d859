"""moekit's ops, in layers that import only downward:

    kernels/     jit code only (Triton and Gluon): the tile schedule, the grouped GEMM, the fused MLP
                 (Triton, and warp-specialised Gluon for Hopper), the row kernel, the routing sort, the
                 router's top-k + softmax (topk), the grouped FP8 quantization (quantize), and the
                 activations' jit act/grad pairs
    runtime/     device facts, every configuration table (configs.py), the one plan-and-launch recipe
                 (launch.py), the host side of each kernel family (quantize.py for quantization, and its
                 plain-torch twin quantize_torch.py), and the backends behind one Protocol with the
                 capabilities the fused paths and quantization ask for (backends.py)
    library.py   every launch as a torch.library custom op with a fake implementation
    the ops      activations (the registry), glu, grouped_linear, grouped_mlp (and quantized_mlp, its
                 quantized nodes), moe_experts, rows (move_rows, the layer's ExpertRoute, permute,
                 unpermute), routing (sort_by_expert), topk (topk_softmax, the router's top-k),
                 splits, quantize (group_quantize, group_dequantize, the quantized weights layers
                 keep); each public op with its reference beside it (float64; quantize's: the same
                 bytes, group by group)

Shape legend of the whole package. Internal tensor names may carry their shape as a suffix (`x_MI`,
`w_NOI`, `row_map_TK`); each letter has this one meaning everywhere:

    N   experts (the groups of a grouped op)
    L   local experts: the experts of one expert-parallel rank (N / EP)
    M   routed rows, the rows of a grouped op: tokens x top-k after sorting by expert
    T   tokens
    K   top-k, experts per token (only that: never a GEMM dimension or a block size)
    I   a linear's in_features
    O   a linear's out_features
    H   hidden size (fc1's I, fc2's O)
    F   expert ffn size: fc1 maps H -> 2F (gate and up), fc2 maps F -> H
    D   features of a row that a row movement carries (any width)
    J   rows summed into one output row by a row movement
    R   rows an expert-parallel rank receives
    C   capacity slots per (source rank, expert) in expert parallelism's capacity mode

A GEMM's reduction dimension is named for what it is (I, M in a weight gradient) or `red`, never K. A
generic width with no meaning of its own is `X`. The GLU block has a word, not a letter:
`glu_interleave_size` (`glu_block` inside kernels). A literal 2 stays a number (`h_M2F`). Public
parameters and error messages use plain names (`bias_scale`, `in_features`), not these suffixes.
"""

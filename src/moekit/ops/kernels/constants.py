"""Numeric constants of the gated activations, shared by their jit pairs (`moekit.ops.kernels.activations`)
and their torch forms (`moekit.ops.activations`). Plain Python: importing this module needs no triton."""

# gpt-oss's clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit), out = g * sigmoid(alpha * g) * (u + 1).
CLAMPED_SWIGLU_LIMIT = 7.0
CLAMPED_SWIGLU_ALPHA = 1.702

"""moekit's jit code (Triton and Gluon) and nothing else: launches live in `moekit.ops.runtime`."""

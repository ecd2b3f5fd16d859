"""One module per op: kernels, launchers, autograd Function and float64 reference together."""

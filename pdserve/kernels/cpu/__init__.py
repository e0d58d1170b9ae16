"""CPU kernels: the native build (native.py) of the C++ sources (csrc/), and the fused calls
that run several kernels' code at once (norm_linear.py, decoder_stack.py, elementwise.py)."""

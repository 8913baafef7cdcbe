"""One module per fused op, Liger-Kernel style: Triton kernels, launchers, autograd Function, API."""

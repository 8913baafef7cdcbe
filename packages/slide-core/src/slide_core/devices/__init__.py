"""Devices that ship with slide-core: the host CPU and CUDA."""

"""kvabi's C++ CPU kernels (compiled on first use) and their ctypes bindings: the lowest layer,
used by the ABI's conversions and the models' and engine's fast paths."""

"""csa-codegen: renders JAX Pallas kernels for the DeepSeek-V4 CSA StreamIndex score from a spec."""

__version__ = "0.1.0"

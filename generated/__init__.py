"""Kernel families rendered by codegen: one subpackage per spec. Needs only JAX at run time."""

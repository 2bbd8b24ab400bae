"""Modules ``codegen render`` copies, as they are, into every generated family package.

``_geometry`` holds the tile geometry the generator and the generated kernels share; ``_runtime``
holds what every variant shares at run time, and reads the spec's few constants from the family's
rendered ``_family`` module (so it imports only inside a generated package). Both need only JAX.
"""

"""Modules ``codegen render`` copies, as they are, into every generated family package.

``_geometry`` holds the tile geometry the generator and the generated kernels share. What every variant
shares at run time is split by concern, each module importing only those above it:

- ``_checks``: the call contract (every argument checked on shapes and dtypes);
- ``_fp8``: float8 keys' quantisation and the kernels' exact float8 widening;
- ``_mesh``: what makes the kernels work inside ``jax.shard_map``, and ``sharded_score``;
- ``_kernel_ops``: pieces of the dense kernel bodies (compute blocks, masks, matmul policies, gradients);
- ``_operands``: a call's inputs padded and ranged for the dense kernels, and their ``pallas_call``;
- ``_gather``: what the sparse kernels share (k's windows, slot orders, row loops, their ``pallas_call``);
- ``_autodiff``: the custom-VJP wiring of ``score`` and ``sparse_score``, and the reference backward;
- ``_take``: the dense route's take of each query's selected slots from its scores, and its transpose;
- ``_helpers``: the family's functions for callers (``Variants``, ``causal_kv_range``, ``topk_indices``,
  the indexer loss);
- ``_topk``: ``score_topk``, top_k selection without the ``[B, S, W]`` scores.

They read the spec's few constants from the family's rendered ``_family`` module (so they import only
inside a generated package), and need only JAX.
"""

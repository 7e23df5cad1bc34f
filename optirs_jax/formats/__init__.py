"""Block-wise 8-bit storage formats of optimizer state: the codes and the blocks.

- :mod:`~optirs_jax.formats.codes`: the dynamic tree maps of Dettmers et al. (2022), as
  tables (decoding a lookup, encoding two: a bucket of the float's bits, then its threshold).
- :mod:`~optirs_jax.formats.blockwise`: :class:`~optirs_jax.formats.blockwise.Quantized8bit`
  (one code per element, one float32 absmax per block of a row) in the ``"dynamic8"`` and
  ``"fp8"`` formats, and the quantize and dequantize passes both the jnp reference and the
  kernels run.

A layer below the optimizers (``optirs_jax.transforms`` stores any optimizer's state in
these formats; ``optirs_jax.quantization`` holds the 8-bit Adam kernel and the public names).
"""

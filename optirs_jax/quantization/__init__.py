"""Quantization: quantization-aware training and 8-bit optimizer state.

- :func:`fake_quant` and :func:`fake_quant_fp8`: quantize-dequantize (int2..int16,
  symmetric or asymmetric, per tensor or per channel; float8 e4m3fn/e5m2) with
  straight-through gradients, for quantization-aware training.
- :func:`calibrate` and :func:`ema_calibrate`: clipping ranges from data.
- :func:`adam8bit` and :func:`adamw8bit`: Adam whose moments are kept as 8-bit codes on a
  dynamic map with one float32 scale per block (about 75% less optimizer memory), updated
  in one Pallas pass on GPU.
- :func:`quantize_blockwise`, :class:`Quantized8bit` and :func:`code_map`: the 8-bit format
  (its codes live in :mod:`optirs_jax.formats`).

Every other optimizer with state takes ``state_quantization="dynamic8"`` or ``"fp8"``
(with ``quantization_block_size`` and ``min_quantized_size``): its fields are stored in the
same format, decoded before and encoded after its float32 step
(``optirs_jax.lion(1e-4, state_quantization="fp8")``).
"""

from optirs_jax.formats.blockwise import Quantized8bit, quantize_blockwise
from optirs_jax.formats.codes import code_map
from optirs_jax.quantization._adam8bit import Adam8bitState, adam8bit, adamw8bit, state_nbytes
from optirs_jax.quantization._fake import calibrate, ema_calibrate, fake_quant, fake_quant_fp8

__all__ = [
    "Adam8bitState", "Quantized8bit", "adam8bit", "adamw8bit", "calibrate", "code_map",
    "ema_calibrate", "fake_quant", "fake_quant_fp8", "quantize_blockwise", "state_nbytes",
]

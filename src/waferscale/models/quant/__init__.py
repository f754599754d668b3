"""Weight-only quantized weights: our four block layouts (layouts.py), GGUF's formats repacked into them losslessly
(gguf_blocks.py), and the linear and embedding modules that serve from them (modules.py, through
kernels/quant_kernels.c), with no float copy kept.

A weight [N, K] is scale * q + min per group of `group` weights along K:
  int8: q one signed byte (Q8_0, --quantization int8) or one unsigned byte 0..127 (Q5_K's 5-bit values);
  int6: Q6_K's 6-bit q, 24 bytes a 32-weight block: the low four bits as int4 holds them, then 8 bytes, byte i
        holding the top two bits of weights i, i + 8, i + 16 and i + 24 in its bit pairs 0, 2, 4, 6; q - 32;
  int5: Q5_0's and Q5_1's 5-bit q as GGUF stores it, 20 bytes a 32-weight block: the low four bits as int4 holds
        them, then a little-endian uint32 whose bit j is weight j's fifth; signed (Q5_0) means q - 16;
  int4: q one nibble 0..15, two a byte (Q4_0, Q4_1, Q4_K, --quantization int4).
Scales and mins are [N, K / group] in one of three formats (QuantWeight.scale_format); mins may be absent
(symmetric): float32 (--quantization int8, and int4 where K is not a multiple of 256); float16 as Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 store them; or two levels as GGUF's K-quants store them (and int4 where K allows): bytes
[N, K / group] times a float32 per 256 weights (sup, supm [N, K / 256]). The kernels widen or multiply them out
where they use them (the same float32 value: an f16 times a 6- or 8-bit integer is exact), so a Q4_K weight costs
0.59 bytes instead of 0.75. Every GGUF value decodes to exactly what gguf.quants.dequantize gives.
"""

from waferscale.models.quant.gguf_blocks import from_gguf
from waferscale.models.quant.layouts import (
    GROUP,
    QUANTIZATIONS,
    QuantWeight,
    cat_rows,
    gather_quantized,
    pack_nibbles,
    quantize,
    weight_from_values,
)
from waferscale.models.quant.modules import ACT_MODE, ACTIVATION_MODES, QuantEmbedding, QuantLinear

__all__ = [
    "ACTIVATION_MODES",
    "ACT_MODE",
    "GROUP",
    "QUANTIZATIONS",
    "QuantEmbedding",
    "QuantLinear",
    "QuantWeight",
    "cat_rows",
    "from_gguf",
    "gather_quantized",
    "pack_nibbles",
    "quantize",
    "weight_from_values",
]

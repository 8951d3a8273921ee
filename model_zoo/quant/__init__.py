"""What a quantized checkpoint is, read by both the quantizer (calibrate) and the engine (kernels_cu).

int8 (symmetric W8A8 numerics), awq_pack (AutoAWQ GEMM int4 packing), linear (Int8Linear, AwqLinear: the
CPU-side linears), formats (Scheme, compressed-tensors / AutoAWQ configs and tensors), checkpoint (a loaded
checkpoint -> ModelWeights). Modules are imported where used; nothing is re-exported here.
"""

"""What a quantized checkpoint is, read by both the quantizer (calibrate) and the engine (kernels_cu).

int8 (symmetric W8A8 numerics), fp8 (E4M3 W8A8 numerics), awq_pack (AutoAWQ GEMM int4 packing), linear
(Int8Linear, Fp8Linear, AwqLinear: the CPU-side linears), gptq (GPTQ int4 read onto the AWQ layout), ct_config
(compressed-tensors configs), fp8_format (fp8 checkpoints), formats (Scheme, compressed-tensors / AutoAWQ /
GPTQ configs and tensors), checkpoint (a loaded checkpoint -> ModelWeights). Modules are imported where used; nothing is re-exported here.
"""

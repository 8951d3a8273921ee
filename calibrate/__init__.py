"""Choosing ranges and quantizing: collectors, range functions, calibration stats, capture, INT8, FP8, AWQ.

Modules are imported where used (nothing heavy runs on `import calibrate`): methods (CalibMethod,
CalibConfig), collectors (MaxCollector, HistogramCollector, ChannelStatsCollector), ranges (amax_* and
compute_amax, fake_quant, sqnr_db; on the int8 or the fp8 grid, fp8_grid), stats (CalibStats, the stats.safetensors file).
"""

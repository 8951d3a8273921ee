"""Choosing ranges and quantizing: collectors, range functions, calibration stats, capture, INT8, AWQ.

Modules are imported where used (nothing heavy runs on `import calibrate`): methods (CalibMethod,
CalibConfig), collectors (MaxCollector, HistogramCollector, ChannelStatsCollector), ranges (amax_* and
compute_amax, fake_quant, sqnr_db), stats (CalibStats, the stats.safetensors file).
"""

"""Developer benchmarks of the calibration and quantization stages (`python -m calibrate.lab.NAME`); no product
module imports them, and no test runs them."""

"""Measurement library: what calibration and the benchmarks share (the plain twin and batches `loading`, paired
timing `timing`, step costs `costs`, quality views `quality`, forced exits `forced`, exit profiles `profile`). Imports
the runtime and `utils`, never `tools`."""

"""bench: the model zoo and the benchmarks behind `make bench`."""

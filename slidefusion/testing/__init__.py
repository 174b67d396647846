"""Test support shared by the test suite and the benchmarks: tiny random models of every family."""

"""Benchmarks that ship with ppqa: the paper-grid `ppqa bench` (`grid`)."""

"""The published DFlash benchmarks: their datasets as z-lab loads and formats them (benchmarks.py), the protocols
that pick a subset, template and tokenize them and stop decoding (protocols.py), and the acceptance lengths z-lab
published on them (numbers.py)."""

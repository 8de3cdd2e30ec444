"""The published DFlash benchmarks: their datasets and how z-lab formats a row (benchmarks.py), the protocols that
pick a subset, template and tokenize them and stop decoding (protocols.py, prompt_set.py), and the acceptance
lengths z-lab published on them (numbers.py). Their rows are read outside dflash_core, where the hub is reached:
dflash_eval.services.benchmark_data."""

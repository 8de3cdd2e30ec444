"""`python -m dflash_eval.cli ...`, as the tests and benchmarks run the command line."""

from . import main

main()

"""Layer benchmark script: the same as ``lrmoe bench layer`` (see lrmoe/bench/layer.py).

    python benchmarks/layer_bench.py --shapes qwen3-30b-a3b --tokens 32768
"""
import argparse

from lrmoe.bench.cli import add_layer_arguments, run_layer

if __name__ == "__main__":
    run_layer(add_layer_arguments(argparse.ArgumentParser(description=__doc__)).parse_args())

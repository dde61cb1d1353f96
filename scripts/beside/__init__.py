"""The pieces of `python -m scripts.bench.beside_record`: the record's script and data read as it reads them, one
side's run measured from outside, the report, and the kernels stand-in."""

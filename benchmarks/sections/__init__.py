"""The sections of the benchmark, one module each: ``python -m benchmarks --only <name>``.

A section imports the harness and the shared helpers of ``benchmarks/``, never another section.
"""

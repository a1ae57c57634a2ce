"""GPU benchmarks of the INT2 kernels (run as ``python -m benchmarks.<name>``; each has a ``--smoke``
mode that runs under ``TRITON_INTERPRET=1`` on a CPU):

* :mod:`.bench_decode` -- decode attention vs BF16 (SGLang's Triton decode kernel, torch SDPA);
* :mod:`.bench_step` -- the served decode step's rotations and write, per engine;
* :mod:`.profile_decode` -- per-kernel GPU times of one decode call (torch profiler);
* :mod:`.sweep_decode` -- the decode config grid (engines x config fields x split counts).

Results are recorded in docs/benchmarks.md; docs/kernels.md says which defaults they chose.
"""

"""Five-dimensional parallelism, one small module per dimension.

- ``collectives``: the primer, each collective with its ring cost, and a ring all-reduce by hand
- ``tensor``: Megatron tensor parallelism (column/row-parallel layers, f and g), and DTensor's version
- ``sequence``: sequence parallelism (reduce-scatter + all-gather) and activation memory per rank
- ``context``: context parallelism: ring attention and the all-gather-K/V variant
- ``pipeline``: a schedule simulator (GPipe, 1F1B, interleaved, ZB-H1/H2, DualPipe, DualPipeV) and a real pipeline
- ``expert``: a top-k router with capacity and all-to-all expert parallelism
- ``planner``: device meshes, Llama 3 405B's layouts and a layout planner

Data parallelism (DDP, ZeRO, FSDP) is chapter 1's ``llmsys.zero``.
"""

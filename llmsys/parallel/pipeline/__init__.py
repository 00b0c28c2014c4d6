"""Pipeline parallelism: a schedule simulator, and a real pipeline across processes.

A model cut into stages, one per device, processes a batch as m microbatches.
A schedule is each device's order of work:

- F: forward of one microbatch through one stage
- B: backward for the stage's *input* gradient (what the previous stage waits for)
- W: backward for the stage's *weight* gradient (nobody waits for it)
- BW: a full backward (B then W at once), as GPipe and 1F1B do

``simulate`` runs the orders against their dependencies (F after the previous
stage's F; B after the next stage's B; W after its own B) with given durations
and returns a ``Timeline``: every op's start and end on every device, the idle
("bubble") time and the activations held in flight. The schedules:

| schedule | order on device i | bubble (time) |
|---|---|---|
| GPipe | all F, then all BW | (p-1)(F+B+W) |
| 1F1B | p-1-i warm-up F, then F,BW pairs | (p-1)(F+B+W), ≤ p microbatches in flight |
| interleaved 1F1B | v chunks per device (Megatron) | (p-1)(F+B+W)/v |
| ZB-H1 | 1F1B with W split off and delayed p-1 steps | (p-1)(F+B-W) |
| DualPipe | two pipelines in opposite directions, F&B overlapped | DeepSeek-V3 Table 2 |
| DualPipeV | DualPipe folded onto p/2 devices (V shape) | same, on half the devices |

``split_stages`` and ``pipeline_train`` run a real pipeline of a
``llmsys.core.model.Transformer`` over processes with point-to-point sends and receives, executing the very
op orders the simulator produces; its losses equal one-process training.

The package: ``schedules`` (ops, orders, ``Timeline``), ``simulator`` (``simulate``,
``bubble_formula``), ``plot`` (``plot_timeline``), ``runtime`` (the real pipeline).
"""

from llmsys.parallel.pipeline.plot import COLOURS, plot_timeline
from llmsys.parallel.pipeline.runtime import (PipelineStage, log_timeline, pipeline_train, run_schedule,
                                              single_process_train, split_stages)
from llmsys.parallel.pipeline.schedules import (SCHEDULES, Op, Slot, Timeline, dualpipe_orders, dualpipev_orders,
                                                gpipe_orders, interleaved_orders, one_f_one_b_orders,
                                                schedule_orders, zb_h1_orders)
from llmsys.parallel.pipeline.simulator import bubble_formula, simulate

__all__ = [
    "COLOURS", "plot_timeline", "PipelineStage", "log_timeline", "pipeline_train", "run_schedule",
    "single_process_train", "split_stages", "SCHEDULES", "Op", "Slot", "Timeline", "dualpipe_orders",
    "dualpipev_orders", "gpipe_orders", "interleaved_orders", "one_f_one_b_orders", "schedule_orders",
    "zb_h1_orders", "bubble_formula", "simulate",
]

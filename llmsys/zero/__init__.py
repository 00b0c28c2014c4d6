"""ZeRO-1, ZeRO-2 and ZeRO-3 by hand on torch.distributed, then PyTorch's FSDP2.

Data parallel training keeps on every rank the parameters, the gradients and
the optimizer state. ZeRO (Rajbhandari et al., arXiv 1910.02054) splits them
into N shards, one per rank:

- ZeRO-1 shards the optimizer state: every rank still computes full gradients,
  reduce-scatters them (each rank gets the sum for its shard), runs AdamW on
  its shard of the parameters and all-gathers the updated shards.
- ZeRO-2 also shards the gradients: a unit's gradient is reduce-scattered as
  soon as backward has produced it, and the full gradient is freed.
- ZeRO-3 also shards the parameters: a unit's parameters are all-gathered just
  before its forward, freed after it, gathered again for its backward.

Here a *unit* is one transformer block, plus one unit for the rest of the
model (embeddings, final norm, output head): the same grouping as FSDP2 with
``fully_shard`` on every block and then on the root (any other module names
its own units). Each unit's parameters
live in one flat fp32 buffer, padded with zeros to a multiple of the world
size so that every rank owns an equal, contiguous slice. Padding never
changes training (its parameters and gradients stay 0) and is counted in the
bytes reported: at most N - 1 elements per unit.

Everything here trains in fp32 without a master copy, so the byte constants
of the ZeRO table change: a parameter costs 4 bytes, its gradient 4, AdamW's
m and v 8 (K = 8), 16 bytes per parameter in all, the same total as
mixed-precision Adam (2 + 2 + 12) split differently. ``FP32_ADAMW`` and
``MIXED_ADAMW`` hold both sets for ``llmsys.core.accounting.zero_bytes_per_device``.

Communication per rank and step, for Ψ bytes of parameters on a ring of N ranks:
DP all-reduces the gradients, 2(N-1)/N·Ψ; ZeRO-1/2 reduce-scatter the gradients
and all-gather the parameters, the same 2(N-1)/N·Ψ; ZeRO-3 all-gathers the
parameters twice (forward and backward) and reduce-scatters the gradients,
3(N-1)/N·Ψ, 1.5× DP. The ZeRO paper's 2Ψ and 3Ψ are the large-N limits.

The package, file by file:

- ``estimates``: the ZeRO table, bytes sent, activations, the plot;
- ``ddp``, ``sharded_optimizer``, ``fsdp``: DDP with bucketed all-reduce
  overlapped with backward, ZeRO-1 around any ``torch.optim`` class (which,
  like it, skips parameters without a gradient), and ZeRO-3 from scratch
  (parameter names kept, FSDP2's ``MixedPrecisionPolicy``), each for any
  ``nn.Module`` (``units`` lays out the flat buffers);
- ``engine``: ``ZeroEngine``, the chapter's Transformer at stage 0 to 3;
- ``training``: the same run on one process or N (the equality checks);
- ``fsdp2``: PyTorch's ``fully_shard`` on the same runs; ``checkpoints``:
  distributed checkpoints written atomically; ``activations``: activation
  checkpointing and what it saves;
- ``cli``: ``torchrun --nproc-per-node=N -m llmsys.zero``.
"""

from llmsys.zero.activations import (LiveBytes, activation_checkpointing_cost, checkpoint_blocks,
                                     recompute_flops_estimate)
from llmsys.zero.checkpoints import COMPLETE, load_checkpoint, save_checkpoint
from llmsys.zero.cli import main
from llmsys.zero.ddp import DistributedDataParallel
from llmsys.zero.engine import ZeroEngine, block_names
from llmsys.zero.estimates import (FP32_ADAMW, MIXED_ADAMW, STAGE_NAMES, STAGES, comm_bytes_estimate,
                                   memory_per_rank, mixed_precision_state_bytes, padded_numel,
                                   plot_memory_per_rank, state_bytes_estimate)
from llmsys.zero.fsdp import FullyShardedDataParallel, GatherParams
from llmsys.zero.fsdp2 import (fsdp_setup, default_mp_policy, fsdp_gradients, shard_with_fsdp2,
                               single_process_gradients, train_fsdp)
from llmsys.zero.sharded_optimizer import ShardedOptimizer
from llmsys.zero.training import (TrainConfig, adamw, build_model, global_batch, local_batch, mean_over_ranks,
                                  tiny_model_config, train_single_process, train_zero)

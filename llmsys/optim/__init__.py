"""Optimizers from scratch: SGD to AdamW (chapter 7), Muon and QK-clip (chapter 8).

- ``adamw``: the update rules as small functions ``*_update(p, grad, state, **hp)`` and the
  optimizer classes that loop over parameters and call them; the weight-decay experiments.
- ``decoupling``: Loshchilov & Hutter's decoupling experiment on an MLP that overfits, over seeds.
- ``muon``: Newton–Schulz orthogonalisation, Muon, and AdamW for what is not a hidden matrix.
- ``training``: the same model trained with either optimizer at equal tokens.
- ``qk_clip``: the max attention logit per head and QK-clip (MuonClip with Muon).
- ``against_torch``: each scratch optimizer against its torch.optim counterpart.

References:
1) Loshchilov & Hutter, Decoupled Weight Decay Regularization (ICLR 2019)
2) Keller Jordan, Muon (kellerjordan.github.io/posts/muon; github.com/KellerJordan/Muon)
3) Moonshot AI, Muon is Scalable for LLM Training (Moonlight, arXiv 2502.16982)
4) Kimi K2 (arXiv 2507.20534): QK-Clip and MuonClip
"""

from llmsys.optim.adamw import (
    sgd_update, rmsprop_update, adam_update, adamw_update, ScratchOptimizer, SGD, RMSProp, Adam,
    AdamW, zero_gradient_decay, effective_decay, state_bytes, decay_trajectories, DECAY_CONVENTIONS,
    decay_optimizer, regression_task, decay_run, lr_wd_grid)
from llmsys.optim.decoupling import (
    classification_task, mlp_run, best_decay, argmin_slope, decoupling_grid)
from llmsys.optim.muon import (
    NS_COEFFICIENTS, newton_schulz, ADJUST_LR_FNS, adjust_lr, muon_update, Muon, adam_update_rms,
    split_muon_adamw, Chain, build_optimizer, newton_schulz_flops, stable_rank, effective_rank)
from llmsys.optim.qk_clip import (
    attention_logits, head_max_logits, MaxLogitTracker, attention_inputs, max_logits_from_inputs,
    attention_max_logits, qk_clip_, mla_clip_factors)
from llmsys.optim.training import (
    random_batch, evaluate, train_lm, probe_run, tokens_to_reach)
from llmsys.optim.against_torch import (
    SCRATCH_AND_TORCH, compare_with_torch)

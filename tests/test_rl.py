"""RL for LLMs: each rung of the ladder against its definition (REINFORCE's expected gradient,
GAE's direct sum, PPO's clip edges, k3's expectation), GRPO's advantages and loss against the
published numbers and against TRL's own code, the Countdown reward rules, KV-cached sampling
against a full recompute, and a short GRPO run whose pass rate goes up."""

import copy
import math
import random
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from llmsys import rl
from llmsys.core.model import ModelConfig, Transformer



def tiny_policy(vocab, seed=0, max_seq_len=24):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=max_seq_len,
                      tie_embeddings=True)
    return Transformer(cfg).eval()


# ----------------------------------------------------------------------------- REINFORCE and baselines


def test_discounted_returns_match_direct_sum():
    r = torch.randn(3, 7)
    for gamma in (0.0, 0.9, 1.0):
        want = torch.stack([sum(gamma ** (k - t) * r[:, k] for k in range(t, 7)) for t in range(7)], dim=1)
        torch.testing.assert_close(rl.discounted_returns(r, gamma), want)


def bandit_gradients(theta, rewards, baseline):
    """Per-action REINFORCE gradient g(a) = -∇ loss for a softmax bandit, and π(a)."""
    grads = []
    for a in range(len(rewards)):
        th = theta.clone().requires_grad_(True)
        logp = F.log_softmax(th, -1)[a].reshape(1)
        loss = rl.reinforce_loss(logp, rewards[a].reshape(1), baseline)
        (g,) = torch.autograd.grad(-loss, th)
        grads.append(g)
    return torch.stack(grads), F.softmax(theta, -1)


def test_reinforce_expected_gradient_is_the_policy_gradient_and_a_baseline_cuts_variance():
    torch.manual_seed(0)
    theta, rewards = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 2.0
    th = theta.clone().requires_grad_(True)
    (true_grad,) = torch.autograd.grad((F.softmax(th, -1) * rewards).sum(), th)  # ∇J exactly
    variances = {}
    for name, b in [("none", None), ("mean reward", (F.softmax(theta, -1) * rewards).sum())]:
        g, pi = bandit_gradients(theta, rewards, b)
        expected = (pi[:, None] * g).sum(0)
        torch.testing.assert_close(expected, true_grad)  # unbiased with or without the baseline
        variances[name] = (pi * (g - expected).pow(2).sum(-1)).sum().item()
    assert variances["mean reward"] < 0.2 * variances["none"], variances


def test_reinforce_loss_ignores_masked_steps():
    logp, ret = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float)
    loss = rl.reinforce_loss(logp, ret, mask=mask)
    loss.backward()
    assert torch.all(logp.grad[0, 2:] == 0)
    torch.testing.assert_close(loss, -(logp * ret * mask).sum() / 6)


# ----------------------------------------------------------------------------- GAE and actor-critic


def test_gae_recurrence_equals_direct_sum_of_td_errors():
    torch.manual_seed(1)
    r, v = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
    for gamma, lam in [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.5, 0.7)]:
        next_v = torch.cat([v[:, 1:], torch.zeros(4, 1, dtype=v.dtype)], dim=1)
        delta = r + gamma * next_v - v
        want = torch.stack([sum((gamma * lam) ** (k - t) * delta[:, k] for k in range(t, 9)) for t in range(9)], 1)
        adv, ret = rl.gae(r, v, gamma, lam)
        torch.testing.assert_close(adv, want)
        torch.testing.assert_close(ret, want + v)
    adv1, _ = rl.gae(r, v, 0.9, 1.0)  # λ = 1: Monte-Carlo return minus the value
    torch.testing.assert_close(adv1, rl.discounted_returns(r, 0.9) - v)


def test_gae_with_mask_equals_gae_on_the_truncated_episode():
    r, v = torch.randn(1, 8), torch.randn(1, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float)
    adv, _ = rl.gae(r, v, 0.95, 0.9, mask)
    short, _ = rl.gae(r[:, :5], v[:, :5], 0.95, 0.9)
    torch.testing.assert_close(adv[:, :5], short)
    assert torch.all(adv[:, 5:] == 0)


def test_actor_critic_with_lambda_one_is_reinforce_with_the_critic_as_baseline():
    torch.manual_seed(2)
    logp, values = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    r = torch.randn(3, 6)
    total, policy_loss, value_loss = rl.actor_critic_loss(logp, values, r, gamma=1.0, lam=1.0, value_coef=0.5)
    returns = rl.discounted_returns(r, 1.0)
    torch.testing.assert_close(policy_loss, rl.reinforce_loss(logp, returns, baseline=values.detach()))
    torch.testing.assert_close(value_loss, ((values - returns) ** 2).mean())
    total.backward()
    torch.testing.assert_close(values.grad, 0.5 * 2 * (values - returns).detach() / values.numel())


# ----------------------------------------------------------------------------- PPO


def test_ppo_clip_at_the_edges():
    eps = 0.2
    ratio = torch.tensor([1.3, 1.3, 0.7, 0.7, 1.0, 1.2, 0.8], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, 1.0, -1.0])
    obj = rl.ppo_clip_objective(ratio, adv, eps)
    # A > 0 past 1+ε: capped at 1.2A; A < 0 below 1-ε: capped at 0.8A; otherwise the pessimistic ρA
    torch.testing.assert_close(obj, torch.tensor([1.2, -1.3, 0.7, -0.8, 2.0, 1.2, -0.8]))
    obj.sum().backward()
    # no gradient where the clip is active (the update has gone far enough), ρ·A's gradient A elsewhere
    torch.testing.assert_close(ratio.grad, torch.tensor([0.0, -1.0, 1.0, 0.0, 2.0, 1.0, -1.0]))


def test_ppo_loss_at_ratio_one_has_the_policy_gradient():
    logp = torch.randn(4, 5, requires_grad=True)
    adv = torch.randn(4, 5)
    rl.ppo_loss(logp, logp.detach(), adv).backward()
    torch.testing.assert_close(logp.grad, -adv / adv.numel())


# ----------------------------------------------------------------------------- GRPO advantages


def test_group_advantages_reference_numbers():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0])
    trl = rl.group_advantages(r, 4)  # TRL: Bessel std + 1e-4
    torch.testing.assert_close(trl, torch.tensor([0.4999, 0.4999, 0.4999, -1.4997]), atol=1e-4, rtol=0)
    pop = rl.group_advantages(r, 4, std="population")
    torch.testing.assert_close(pop, torch.tensor([0.577, 0.577, 0.577, -1.732]), atol=1e-3, rtol=0)
    dr = rl.group_advantages(r, 4, scale="none")  # Dr. GRPO
    torch.testing.assert_close(dr, torch.tensor([0.25, 0.25, 0.25, -0.75]))


def test_group_advantages_are_per_group_and_zero_for_equal_rewards():
    r = torch.tensor([1.0] * 8 + [0.1] * 8 + [0.0, 1.0, 0.1, 1.0, 0.0, 0.0, 0.1, 0.1])
    for scale in rl.SCALE_REWARDS:
        adv = rl.group_advantages(r, 8, scale=scale)
        assert torch.isfinite(adv).all()
        assert torch.all(adv[:16] == 0)  # two groups of equal rewards: exactly no signal, and no NaN
        assert abs(adv[16:].sum().item()) < 1e-5  # every group's advantages sum to zero
    batch = rl.group_advantages(r, 8, scale="batch")
    torch.testing.assert_close(batch[16:], (r[16:] - r[16:].mean()) / (r.std() + 1e-4))


def test_group_advantages_match_trl_definition():
    from trl.trainer.utils import nanstd
    torch.manual_seed(3)
    rewards = torch.rand(6 * 8)
    grouped = rewards.view(-1, 8)
    # TRL 1.16 GRPOTrainer._generate_and_score_completions with scale_rewards="group"
    mean = grouped.mean(1).repeat_interleave(8)
    std = nanstd(grouped, dim=1).repeat_interleave(8)
    torch.testing.assert_close(rl.group_advantages(rewards, 8), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(rl.group_advantages(rewards, 8, scale="none"), rewards - mean)


@pytest.mark.parametrize("bad, match", [
    (dict(rewards=torch.ones(4), group_size=1), "G >= 2"),
    (dict(rewards=torch.ones(6), group_size=4), "multiple of group_size"),
    (dict(rewards=torch.tensor([1.0, float("nan")]), group_size=2), "NaN"),
    (dict(rewards=torch.ones(4), group_size=2, scale="std"), "scale must be"),
])
def test_group_advantages_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        rl.group_advantages(**bad)


# ----------------------------------------------------------------------------- KL k3


def test_k3_is_nonnegative_and_its_expectation_is_the_kl():
    torch.manual_seed(4)
    logits, ref_logits = torch.randn(3, 11, dtype=torch.float64), torch.randn(3, 11, dtype=torch.float64)
    logp, ref = F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1)
    k3 = rl.kl_k3(logp, ref)  # every token of the vocabulary, as if it had been sampled
    assert torch.all(k3 >= 0)
    expected = (logp.exp() * k3).sum(-1)  # E over tokens drawn from π_θ
    torch.testing.assert_close(expected, (logp.exp() * (logp - ref)).sum(-1))  # KL(π_θ ‖ π_ref)
    assert torch.all(rl.kl_k3(logp, logp) == 0)


# ----------------------------------------------------------------------------- GRPO loss


def random_batch(B=6, T=5, seed=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    mask[3] = 0  # an empty completion
    adv = torch.randn(B, generator=g)
    return logp, old, ref, adv, mask


def loop_reference(logp, old, ref, adv, mask, beta, eps, loss_type, max_len):
    """The DeepSeekMath objective written out token by token."""
    total, tokens = 0.0, 0
    per_seq = []
    B, T = len(logp), len(logp[0])
    for i in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if mask[i][t]:
                rho = math.exp(logp[i][t] - old[i][t])
                surrogate = min(rho * adv[i], min(max(rho, 1 - eps), 1 + eps) * adv[i])
                kl = math.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1
                s += -surrogate + beta * kl
                n += 1
        per_seq.append(s / max(n, 1))
        total += s
        tokens += n
    if loss_type == "grpo":
        return sum(per_seq) / len(per_seq)
    if loss_type == "dr_grpo":
        return total / (B * max_len)
    return total / max(tokens, 1)


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
def test_grpo_loss_matches_the_objective_written_out(loss_type):
    logp, old, ref, adv, mask = random_batch()
    got = rl.grpo_loss(logp, old, adv, mask, ref, beta=0.04, epsilon=0.2, loss_type=loss_type, max_completion_length=8)
    want = loop_reference(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.04, 0.2, loss_type, 8)
    assert got.item() == pytest.approx(want, rel=1e-5)


def trl_compute_loss(logp, old, ref, adv, mask, beta, eps, loss_type, max_len):
    """TRL 1.16's own GRPOTrainer._compute_loss on given per-token log-probs: the trainer
    object is replaced by the few attributes the loss reads."""
    from trl import GRPOTrainer as grpo_trainer
    leaf = logp.clone().requires_grad_(True)

    class Accelerator:
        num_processes, sync_gradients = 1, True

        def gather(self, x):
            return x

        def reduce(self, x, reduction="sum"):
            return x

    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type, epsilon_low=eps, epsilon_high=eps, use_vllm=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_len, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        accelerator=Accelerator(), _metrics={"train": defaultdict(list)})
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    loss = grpo_trainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
def test_grpo_loss_and_gradient_match_trl(loss_type):
    logp, old, ref, adv, mask = random_batch()
    want_loss, want_grad = trl_compute_loss(logp, old, ref, adv, mask, 0.04, 0.2, loss_type, 8)
    x = logp.clone().requires_grad_(True)
    got = rl.grpo_loss(x, old, adv, mask, ref, beta=0.04, epsilon=0.2, loss_type=loss_type, max_completion_length=8)
    got.backward()
    torch.testing.assert_close(got.detach(), want_loss)
    torch.testing.assert_close(x.grad, want_grad)


def test_length_normalization_grpo_vs_dr_grpo():
    """At ρ = 1 without KL, a token's gradient is -Â/|o| under GRPO (a long wrong answer is
    pushed down less per token) and -Â/(B·L) under Dr. GRPO (the same for every length)."""
    B, T = 4, 10
    lengths = torch.tensor([2, 5, 10, 10])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0])
    for loss_type, per_token in [("grpo", -adv[:, None] / lengths[:, None] / B), ("dr_grpo", -adv[:, None] / (B * T))]:
        logp = torch.zeros(B, T, requires_grad=True)
        rl.grpo_loss(logp, logp.detach(), adv, mask, loss_type=loss_type).backward()
        torch.testing.assert_close(logp.grad, per_token.expand(B, T) * mask)


def test_grpo_loss_empty_completions_give_no_nan():
    logp = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    for loss_type in rl.LOSS_TYPES:
        loss = rl.grpo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.0]), mask, logp.detach(), beta=0.1,
                            loss_type=loss_type)
        loss.backward()
        assert loss.item() == 0.0 and torch.all(logp.grad == 0)
        logp.grad = None


def test_grpo_loss_bad_input():
    logp, old, ref, adv, mask = random_batch()
    with pytest.raises(ValueError, match="one value per completion"):
        rl.grpo_loss(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        rl.grpo_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        rl.grpo_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="same shape"):
        rl.grpo_loss(logp, old[:, :3], adv, mask)


# ----------------------------------------------------------------------------- the task


@pytest.mark.parametrize("completion, reward", [
    ("<answer>3*4+5</answer>", 1.0),
    ("<answer> (3 * 4) + 5 </answer>...", 1.0),
    ("<answer>3+4+5</answer>", 0.1),  # well formed, wrong value
    ("<answer>3*4+5+5</answer>", 0.1),  # a number used twice
    ("<answer>12+5</answer>", 0.1),  # numbers not the given ones
    ("<answer>3*4+5=17</answer>", 0.1),  # outside the whitelist
    ("<answer>3+4+5</answer><answer>5+3*4</answer>", 1.0),  # the last answer counts
    ("3*4+5", 0.0),  # no answer tags
    ("<answer>3*4+5", 0.0),
])
def test_countdown_reward_follows_tinyzero_rules(completion, reward):
    assert rl.countdown_reward(completion, (3, 4, 5), 17) == reward


def test_countdown_reward_is_safe_and_exact():
    assert rl.countdown_reward("<answer>4/(5-5)</answer>", (4, 5, 5), 1) == 0.1  # division by zero
    assert rl.countdown_reward("<answer>9**9**9</answer>", (9, 9, 9), 1) == 0.1  # no powers, never evaluated
    assert rl.countdown_reward("<answer>8/(3-8/3)</answer>", (8, 3, 8, 3), 24) == 1.0  # within 1e-5
    with pytest.raises(ValueError):
        rl.evaluate_expression("__import__('os')")


def test_countdown_problems_are_solvable_and_splits_disjoint():
    task = rl.Countdown(sizes=(2, 3))
    for p in random.Random(0).sample(task.train, 200) + task.test[:50]:
        for expr in p.solutions:
            assert rl.countdown_reward(f"<answer>{expr}</answer>", p.numbers, p.target) == 1.0
    key = lambda p: (p.numbers, p.target)  # noqa: E731
    assert not {key(p) for p in task.train} & {key(p) for p in task.test}
    drawn = task.sample(400, random.Random(1))
    assert 0.4 < sum(len(p.numbers) == 2 for p in drawn) / 400 < 0.6  # sizes drawn uniformly
    assert len({len(task.prompt(p)) for p in drawn}) == 1  # one prompt width: one batch
    with pytest.raises(ValueError, match="sizes"):
        rl.Countdown(sizes=(4,))


def test_demonstrations_are_correct_answers_or_answerless_rambles():
    task, rng = rl.Countdown(sizes=(2,)), random.Random(0)
    problem = task.train[0]
    demos = [task.demonstration(problem, rng, ramble_rate=0.3, max_ramble=5) for _ in range(400)]
    rambles = [d for d in demos if "<answer>" not in d]
    assert 0.2 < len(rambles) / 400 < 0.4 and all(set(d) == {"."} and 1 <= len(d) <= 5 for d in rambles)
    assert all(task.reward(problem, d) == (0.0 if d in rambles else 1.0) for d in demos)


def test_char_tokenizer_roundtrip_and_unknown_characters():
    tok = rl.CharTokenizer()
    text = " 3,4:12<answer>3*4</answer>.."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) == len(" 3,4:12") + 1 + 3 + 1 + 2
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("3x4")


# ----------------------------------------------------------------------------- sampling


def test_rollout_batch_keeps_each_completion_up_to_its_eos_and_scores_it():
    tok = rl.CharTokenizer()
    policy = tiny_policy(tok.vocab_size, seed=3)
    task = types.SimpleNamespace(prompt=lambda p: p, reward=lambda p, text: float(len(text)))
    problems = ["1+2", "34", "5"]  # three prompt lengths: three chunks
    batch = rl.rollout(policy, tok, task, problems, 4, 6, generator=torch.Generator().manual_seed(0))
    assert len(batch.chunks) == 3 and batch.mask.shape[0] == 12
    logp = rl.rollout_logprobs(policy, batch)
    assert logp.shape == batch.mask.shape
    # the reward saw the completion's text up to (not including) its EOS; the mask covers the EOS too
    ids = torch.cat([F.pad(c.completions, (0, batch.mask.size(1) - c.completions.size(1))) for c in batch.chunks])
    for row, m, text, reward in zip(ids.tolist(), batch.mask, batch.texts, batch.rewards.tolist()):
        n = int(m.sum())
        kept = row[:n - 1] if row[n - 1] == tok.eos_id else row[:n]
        assert tok.eos_id not in kept and text == tok.decode(kept) and reward == len(text)


def test_greedy_completion_logprobs_match_stepwise():
    model = tiny_policy(vocab=9, seed=1)
    prompts = torch.randint(1, 9, (3, 5), generator=torch.Generator().manual_seed(2))
    ids = model.generate(prompts, 8)[:, 5:]
    logp = rl.completion_logprobs(model, prompts, ids)
    with torch.no_grad():
        for t in range(8):
            step = F.log_softmax(model(torch.cat([prompts, ids[:, :t]], 1))[:, -1], -1)
            torch.testing.assert_close(logp[:, t], step.gather(-1, ids[:, t:t + 1])[:, 0], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the loop


class FirstDigit:
    """A toy task: the prompt is a digit, the reward 1 when the completion starts with it.
    A random policy passes about 1 time in vocab_size."""

    def prompt(self, problem):
        return str(problem)

    def reward(self, problem, completion):
        return 1.0 if completion.startswith(str(problem)) else 0.0

    def sample(self, n, generator, split="train"):
        return [generator.randrange(10) for _ in range(n)]


def test_grpo_run_raises_the_pass_rate():
    tok, task = rl.CharTokenizer(), FirstDigit()
    policy = tiny_policy(tok.vocab_size, seed=0)
    problems = list(range(10)) * 4
    before = rl.evaluate(policy, tok, task, problems, samples_per_problem=8, max_new_tokens=3)
    cfg = rl.GRPOConfig(steps=25, prompts_per_step=8, group_size=8, max_new_tokens=3, lr=1e-2, beta=0.0,
                        warmup_steps=0, seed=0)
    history = rl.train_grpo(policy, tok, task, cfg, progress=False)
    after = rl.evaluate(policy, tok, task, problems, samples_per_problem=8, max_new_tokens=3)
    assert before["pass_rate"] < 0.2 and after["pass_rate"] > before["pass_rate"] + 0.3, (before, after)
    assert set(history) == set(rl.HISTORY_KEYS) and all(len(v) == 25 for v in history.values())
    assert all(math.isfinite(x) for x in history["kl"] + history["loss"] + history["reward"])


def test_grpo_config_bad_input():
    with pytest.raises(ValueError, match="G >= 2"):
        rl.GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="loss_type"):
        rl.GRPOConfig(loss_type="ppo")
    dr = rl.dr_grpo_config(steps=3)
    assert (dr.loss_type, dr.scale_rewards, dr.steps) == ("dr_grpo", "none", 3)


def test_policy_is_cached_and_reloaded_without_training(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path))
    spec = rl.PolicySpec(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, sft_steps=3, batch_size=8)
    policy, tok, task = rl.load_policy(spec, progress=False)
    assert rl.policy_path(spec).exists()
    monkeypatch.setattr(rl.policy, "sft", lambda *a, **k: pytest.fail("a cached policy must not be retrained"))
    again, _, _ = rl.load_policy(spec, progress=False)
    for a, b in zip(policy.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    rl.policy_path(spec).write_bytes(b"torn")  # a damaged file is rebuilt, not half-loaded
    monkeypatch.undo()
    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="rebuilding"):
        rebuilt, _, _ = rl.load_policy(spec, progress=False)
    for a, b in zip(policy.state_dict().values(), rebuilt.state_dict().values()):
        assert torch.equal(a, b)  # seeded: the same policy again


# ----------------------------------------------------------------------------- memory


def test_training_state_bytes_ppo_holds_a_critic_the_size_of_the_policy():
    policy = tiny_policy(vocab=23)
    n = sum(p.numel() for p in policy.parameters())
    critic = rl.ValueModel(policy)
    assert critic(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5)
    for module in (policy, critic):
        opt = torch.optim.AdamW(module.parameters())
        out = module(torch.zeros(1, 3, dtype=torch.long))
        out.float().sum().backward()
        opt.step()
        # fp32 weight + grad + Adam's m and v: 16 bytes per parameter
        assert rl.training_state_bytes(module, optimizer=opt) == 16 * sum(p.numel() for p in module.parameters())
    n_critic = sum(p.numel() for p in critic.parameters())
    assert n_critic == n + policy.cfg.dim + 1  # the same body, a scalar head instead of the (tied) LM head


def test_rl_state_bytes_formula():
    n = 7_000_000_000
    assert rl.rl_state_bytes(n, "grpo") == 18 * n  # policy 16 + reference 2
    assert rl.rl_state_bytes(n, "ppo") == 34 * n  # + a critic of the same size, trained
    assert rl.rl_state_bytes(n, "ppo", reward_model=True) == 36 * n
    assert rl.rl_state_bytes(n, "grpo", reference=False) == 16 * n  # β = 0 (TRL's default) drops the reference
    with pytest.raises(ValueError, match="algorithm"):
        rl.rl_state_bytes(n, "dpo")


class ConstantPolicy(torch.nn.Module):
    """Every position predicts the same distribution: the filler with probability q."""

    def __init__(self, vocab, filler_id, q):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, 4)
        logits = torch.full((vocab,), math.log((1 - q) / (vocab - 1)))
        logits[filler_id] = math.log(q)
        self.register_buffer("logits", logits)

    def forward(self, idx):
        return self.logits.expand(*idx.shape, -1)


def test_ramble_stats_match_the_geometric_formula():
    tok, task = rl.CharTokenizer(), rl.Countdown()
    q, max_len = 0.7, 10
    policy = ConstantPolicy(tok.vocab_size, tok.encode(".")[0], q)
    stats = rl.ramble_stats(policy, tok, task, task.test[:5], max_len=max_len)
    assert stats["start"] == pytest.approx(q)
    # started: one filler for sure, then each further one with probability q, at most max_len in all
    assert stats["length"] == pytest.approx(sum(q ** k for k in range(max_len)), rel=1e-5)


def test_train_grpo_with_bf16_autocast_and_a_callback():
    tok, task = rl.CharTokenizer(), FirstDigit()
    policy = tiny_policy(tok.vocab_size, seed=1)
    cfg = rl.GRPOConfig(steps=3, prompts_per_step=4, group_size=4, max_new_tokens=3, warmup_steps=0)
    seen = []
    history = rl.train_grpo(policy, tok, task, cfg, progress=False, autocast_dtype=torch.bfloat16,
                            callback=lambda step, model: seen.append(step) or {"probe": float(step)})
    assert seen == [0, 1, 2] and history["probe"] == [0.0, 1.0, 2.0]
    assert all(math.isfinite(x) for x in history["loss"] + history["kl"])
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the weights stay fp32


def test_train_grpo_runs_a_given_step_function_and_grpo_step_is_its_default():
    tok, task = rl.CharTokenizer(), FirstDigit()
    cfg = rl.GRPOConfig(steps=3, prompts_per_step=4, group_size=4, max_new_tokens=3, warmup_steps=0, lr=1e-2)
    default, stepped = tiny_policy(tok.vocab_size, seed=2), tiny_policy(tok.vocab_size, seed=2)
    calls = []

    def step_fn(*args):
        calls.append(len(args[5]))  # the problems of this step
        return rl.grpo_step(*args)

    history = rl.train_grpo(default, tok, task, cfg, progress=False)
    same = rl.train_grpo(stepped, tok, task, cfg, progress=False, step_fn=step_fn)
    assert calls == [4, 4, 4] and same == history
    assert all(torch.equal(a, b) for a, b in zip(default.parameters(), stepped.parameters()))
    policy = tiny_policy(tok.vocab_size, seed=3)
    start = [p.detach().clone() for p in policy.parameters()]
    out = rl.grpo_step(policy, copy.deepcopy(policy), rl.make_grpo_optimizer(policy, cfg), tok, task,
                       task.sample(4, random.Random(0)), cfg, torch.Generator().manual_seed(0))
    assert out["advantages"].shape == (16,) and out["logprobs"].shape == out["batch"].mask.shape
    assert any(not torch.equal(a, p) for a, p in zip(start, policy.parameters())) and not out["loss"].requires_grad


class FakeHFTokenizer:
    def __init__(self, eos_token_id=0):
        self.eos_token_id = eos_token_id

    def __len__(self):
        return 300

    def encode(self, text, add_special_tokens=True):
        return [1] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 1)


def test_hf_tokenizer_adapter():
    tok = rl.HFTokenizer(FakeHFTokenizer())
    assert (tok.eos_id, tok.vocab_size) == (0, 300)
    assert tok.decode(tok.encode("<answer>1+2</answer>")) == "<answer>1+2</answer>"
    with pytest.raises(ValueError, match="eos_token_id"):
        rl.HFTokenizer(FakeHFTokenizer(eos_token_id=None))

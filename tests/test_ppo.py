"""PPO with a learned critic: GAE against a plain reverse recursion (and its λ = 1 / λ = 0 ends),
the clipped objective against its case-by-case formula and against TRL's clipped loss, the
per-token rewards, one update on a fixed batch, and a short run whose pass rate goes up."""

import math

import pytest
import torch

from llmsys import rl
from llmsys.rl import ppo
from test_rl import FirstDigit, tiny_policy, trl_compute_loss


def gae_reference(rewards, values, lengths, gamma, lam):
    """GAE by the book, one episode at a time in plain Python: walk back from the last step,
    A_t = δ_t + γλ·A_{t+1}, δ_t = r_t + γ·V_{t+1} - V_t, V after the episode's end = 0."""
    advantages = []
    for r, v, n in zip(rewards, values, lengths):
        row, running = [0.0] * len(r), 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            row[t] = running
        advantages.append(row)
    return torch.tensor(advantages, dtype=torch.float64)


def ragged_episodes(seed=3, B=5, T=9):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [9, 4, 1, 7, 0]  # an empty episode too
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()
    return rewards, values, lengths, mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 0.3), (1.0, 1.0), (0.9, 0.0)])
def test_gae_equals_the_reverse_recursion_reference(gamma, lam):
    rewards, values, lengths, mask = ragged_episodes()
    advantages, returns = rl.gae(rewards, values, gamma, lam, mask)
    want = gae_reference(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(advantages, want)
    torch.testing.assert_close(returns * mask, (want + values) * mask)


def test_gae_ends_are_monte_carlo_returns_and_td_errors():
    rewards, values, lengths, mask = ragged_episodes(seed=4)
    gamma = 0.9
    # λ = 1: the discounted return of the episode, minus V
    mc, _ = rl.gae(rewards, values, gamma, 1.0, mask)
    torch.testing.assert_close(mc, (rl.discounted_returns(rewards * mask, gamma) - values) * mask)
    # λ = 0: the one-step TD error, with V = 0 after the last step of each episode
    td, _ = rl.gae(rewards, values, gamma, 0.0, mask)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(len(values), 1, dtype=values.dtype)], 1)
    torch.testing.assert_close(td, (rewards + gamma * next_values - values) * mask)


def test_clipped_objective_equals_its_formula():
    g = torch.Generator().manual_seed(6)
    ratio, adv = torch.rand(2000, generator=g) * 2, torch.randn(2000, generator=g)
    for eps in (0.1, 0.2, 0.3):
        got = rl.ppo_clip_objective(ratio, adv, eps)
        # PPO eq. 7 by cases: a good action gains at most (1+ε)·A, a bad one is charged at least (1-ε)·A
        want = torch.tensor([min(r, 1 + eps) * a if a >= 0 else max(r, 1 - eps) * a
                             for r, a in zip(ratio.tolist(), adv.tolist())])
        torch.testing.assert_close(got, want)


def test_ppo_loss_equals_trls_clipped_loss():
    """TRL 1.16 has no PPO trainer; its clipped loss lives in GRPOTrainer. With one advantage per
    completion and β = 0, PPO's token mean of the clipped surrogate is its "dapo" loss."""
    g = torch.Generator().manual_seed(7)
    B, T = 5, 6
    logp = -torch.rand(B, T, generator=g) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([6, 3, 1, 5, 2])[:, None]).float()
    adv = torch.randn(B, generator=g)
    want_loss, want_grad = trl_compute_loss(logp, old, old, adv, mask, 0.0, 0.2, "dapo", T)
    x = logp.clone().requires_grad_(True)
    got = rl.ppo_loss(x, old, adv[:, None].expand(B, T), mask, epsilon=0.2)
    got.backward()
    torch.testing.assert_close(got.detach(), want_loss)
    torch.testing.assert_close(x.grad, want_grad)


def fixed_batch(seed=0):
    tok, task = rl.CharTokenizer(), FirstDigit()
    policy = tiny_policy(tok.vocab_size, seed=seed)
    batch = rl.rollout(policy, tok, task, list(range(10)), 4, 3, generator=torch.Generator().manual_seed(seed))
    # an untrained policy rarely scores: fixed 0/1 rewards make the batch informative
    batch.rewards = torch.randint(0, 2, batch.rewards.shape, generator=torch.Generator().manual_seed(seed)).float()
    return policy, batch


def test_token_rewards_put_the_task_reward_on_the_last_token_and_the_kl_on_every_token():
    _, batch = fixed_batch()
    g = torch.Generator().manual_seed(1)
    old, ref = -torch.rand(batch.mask.shape, generator=g), -torch.rand(batch.mask.shape, generator=g)
    rewards = ppo.token_rewards(batch, old * batch.mask, ref * batch.mask, beta=0.1)
    mask = batch.mask.float()
    torch.testing.assert_close(rewards.sum(-1), batch.rewards - 0.1 * ((old - ref) * mask).sum(-1))
    assert torch.all(rewards[mask == 0] == 0)


def test_critic_values_are_the_states_before_each_completion_token():
    policy, batch = fixed_batch()
    critic = rl.ValueModel(policy)
    values = ppo.rollout_values(critic, batch)
    chunk = batch.chunks[0]
    P, L = chunk.prompt_len, chunk.completions.size(1)
    for t in range(L):  # V of prompt + the first t completion tokens, computed alone
        alone = critic(chunk.tokens[:, :P + t])[:, -1]
        torch.testing.assert_close(values[:len(alone), t], alone, rtol=1e-4, atol=1e-5)


def test_one_ppo_update_on_a_fixed_batch_improves_the_surrogate_and_the_critic():
    policy, batch = fixed_batch()
    critic = ppo.make_critic(policy)
    reference = tiny_policy(rl.CharTokenizer().vocab_size, seed=1)
    with torch.no_grad():
        old = rl.rollout_logprobs(policy, batch)
        ref = rl.rollout_logprobs(reference, batch)
        values = ppo.rollout_values(critic, batch)
    mask = batch.mask.float()
    adv, returns = rl.gae(ppo.token_rewards(batch, old, ref, 0.04), values, 1.0, 0.95, mask)
    adv = ppo.whiten(adv, mask)

    def surrogate_and_value_loss():
        with torch.no_grad():
            ratio = torch.exp(rl.rollout_logprobs(policy, batch) - old)
            surrogate = rl.masked_mean(rl.ppo_clip_objective(ratio, adv, 0.2), mask)
            return surrogate.item(), rl.masked_mean((ppo.rollout_values(critic, batch) - returns) ** 2, mask).item()

    surrogate0, value_loss0 = surrogate_and_value_loss()
    assert surrogate0 == pytest.approx(0.0, abs=1e-5)  # ρ = 1 and whitened advantages: the mean of A
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (policy, critic)]
    ppo.ppo_update(policy, critic, *opts, batch, old, adv, returns)
    surrogate1, value_loss1 = surrogate_and_value_loss()
    assert surrogate1 > surrogate0 + 1e-3 and value_loss1 < value_loss0, (surrogate0, surrogate1, value_loss0, value_loss1)


def test_ppo_run_raises_the_pass_rate_and_holds_a_critic_the_size_of_the_policy():
    tok, task = rl.CharTokenizer(), FirstDigit()
    policy = tiny_policy(tok.vocab_size, seed=0)
    problems = list(range(10)) * 4
    before = rl.evaluate(policy, tok, task, problems, samples_per_problem=8, max_new_tokens=3)
    cfg = ppo.PPOConfig(steps=25, prompts_per_step=8, samples_per_prompt=8, max_new_tokens=3, lr=1e-2,
                        critic_lr=1e-2, beta=0.0, warmup_steps=0, seed=0)
    run = ppo.train_ppo(policy, tok, task, cfg, progress=False)
    after = rl.evaluate(policy, tok, task, problems, samples_per_problem=8, max_new_tokens=3)
    assert before["pass_rate"] < 0.2 and after["pass_rate"] > before["pass_rate"] + 0.3, (before, after)
    assert set(run.history) == set(ppo.PPO_HISTORY_KEYS) and all(len(v) == 25 for v in run.history.values())
    assert all(math.isfinite(x) for x in run.history["value_loss"] + run.history["loss"])
    n_policy = sum(p.numel() for p in policy.parameters())
    assert run.policy_bytes == 16 * n_policy  # fp32 weight, gradient, Adam's m and v
    assert run.critic_bytes == 16 * (n_policy + policy.cfg.dim + 1)  # the same body, a scalar head


def test_ppo_config_bad_input():
    with pytest.raises(ValueError, match="samples_per_prompt"):
        ppo.PPOConfig(samples_per_prompt=0)
    with pytest.raises(ValueError, match="critic_lr"):
        ppo.PPOConfig(critic_lr=0.0)

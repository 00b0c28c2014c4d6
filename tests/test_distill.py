"""Distillation: KL directions and their gradients, GJSD against TRL, the Gaussian
mixture's mode covering vs mode seeking, rollouts and masks, the on-policy signal
and loss, and a small on-policy run that must lower the student's reverse KL."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from llmsys import distill
from llmsys.core.model import ModelConfig, Transformer

V = 32


def tiny(seed: int, sharpen: float = 1.0) -> Transformer:
    """A tiny untied model; ``sharpen`` scales the output head so its distributions are peaked."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=V, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64))
    with torch.no_grad():
        model.output.weight.mul_(sharpen)
    return model.eval()


def random_logits(*shape, seed=0, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- divergences


def test_kl_directions_match_torch_distributions():
    s, t = random_logits(3, 5, V, seed=0), random_logits(3, 5, V, seed=1)
    torch.testing.assert_close(distill.forward_kl(s, t), kl_divergence(Categorical(logits=t), Categorical(logits=s)))
    torch.testing.assert_close(distill.reverse_kl(s, t), kl_divergence(Categorical(logits=s), Categorical(logits=t)))
    assert not torch.allclose(distill.forward_kl(s, t), distill.reverse_kl(s, t)), "KL is not symmetric"
    assert distill.forward_kl(s, s).abs().max() < 1e-6 and distill.reverse_kl(t, t).abs().max() < 1e-6


def test_kl_gradients_match_closed_forms():
    s, t = random_logits(4, V, seed=2).requires_grad_(), random_logits(4, V, seed=3)
    p_s, p_t = F.softmax(s.detach(), -1), F.softmax(t, -1)
    (grad,) = torch.autograd.grad(distill.forward_kl(s, t).sum(), s)
    torch.testing.assert_close(grad, p_s - p_t)  # d KL(T‖S) / d z_S = p_S − p_T
    (grad,) = torch.autograd.grad(distill.reverse_kl(s, t).sum(), s)
    log_ratio = p_s.log() - p_t.log()
    kl = (p_s * log_ratio).sum(-1, keepdim=True)
    torch.testing.assert_close(grad, p_s * (log_ratio - kl))  # d KL(S‖T) / d z_S


def test_word_kd_loss_is_tau_squared_kl_with_gradient_over_tau():
    s, t = random_logits(2, 3, V, seed=4).requires_grad_(), random_logits(2, 3, V, seed=5)
    tau = 3.0
    loss = distill.word_kd_loss(s, t, temperature=tau)
    want = tau**2 * kl_divergence(Categorical(logits=t / tau), Categorical(logits=s / tau)).mean()
    torch.testing.assert_close(loss, want)
    (grad,) = torch.autograd.grad(loss, s)
    p_s, p_t = distill.soft_labels(s.detach(), tau), distill.soft_labels(t, tau)
    torch.testing.assert_close(grad, tau * (p_s - p_t) / 6)
    # a higher temperature lifts the smallest probability (the dark knowledge)
    assert distill.soft_labels(t, 4.0).min() > distill.soft_labels(t, 1.0).min()


def test_masked_mean_ignores_masked_positions():
    values, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[0, 1, 1], [1, 0, 0]])
    assert distill.masked_mean(values, mask).item() == pytest.approx((2 + 3 + 4) / 3)
    assert distill.masked_mean(values + 100 * (1 - mask), mask).item() == pytest.approx(3.0)
    assert distill.masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="mask shape"):
        distill.masked_mean(values, mask[:, :2])


def test_generalized_jsd_end_points_and_middle():
    s, t = random_logits(2, 4, V, seed=6), random_logits(2, 4, V, seed=7)
    torch.testing.assert_close(distill.generalized_jsd(s, t, beta=0.0), distill.forward_kl(s, t).mean())
    torch.testing.assert_close(distill.generalized_jsd(s, t, beta=1.0), distill.reverse_kl(s, t).mean())
    # beta = 0.5 is the Jensen-Shannon divergence: symmetric and at most ln 2
    jsd = distill.generalized_jsd(s, t, beta=0.5)
    torch.testing.assert_close(jsd, distill.generalized_jsd(t, s, beta=0.5))
    assert 0 < jsd < math.log(2)
    with pytest.raises(ValueError, match="beta"):
        distill.generalized_jsd(s, t, beta=1.5)


def test_generalized_jsd_matches_trl():
    from trl.experimental.gkd import GKDTrainer  # pinned in the test extra: an API break fails here
    s, t = random_logits(2, 6, V, seed=8), random_logits(2, 6, V, seed=9)
    labels = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(10))
    labels[0, :2] = -100  # prompt
    labels[1, 4:] = -100  # padding
    mask = labels != -100
    for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
        for tau in (1.0, 2.0):
            want = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=tau)
            got = distill.generalized_jsd(s, t, beta=beta, temperature=tau, mask=mask)
            torch.testing.assert_close(got, want, msg=lambda m: f"beta={beta}, temperature={tau}: {m}")


# ---------------------------------------------------------------- which KL on a bimodal teacher


def test_reverse_kl_seeks_one_mode_forward_kl_covers_both():
    p = distill.Mixture(weights=(0.5, 0.5), means=(-3.0, 3.0), stds=(0.6, 0.6))
    mean, std = p.mean_std()
    forward = distill.fit_gaussian(p, "forward", init_mean=0.5)
    assert forward["mean"] == pytest.approx(mean, abs=0.05) and forward["std"] == pytest.approx(std, rel=0.02), \
        "forward KL to a Gaussian family matches the mixture's mean and variance"
    for init, mode in ((0.5, 3.0), (-0.5, -3.0)):
        reverse = distill.fit_gaussian(p, "reverse", init_mean=init)
        assert reverse["mean"] == pytest.approx(mode, abs=0.1) and reverse["std"] == pytest.approx(0.6, rel=0.1), \
            f"reverse KL from {init} should lock onto the mode at {mode}, got {reverse['mean']:.2f} ± {reverse['std']:.2f}"
    with pytest.raises(ValueError, match="direction"):
        distill.fit_gaussian(p, "sideways")


# ---------------------------------------------------------------- rollouts, signal, loss


def test_rollout_logprobs_match_a_full_forward_and_masks_prompt():
    model = tiny(0, sharpen=10)
    prompts = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(0))
    roll = distill.sample_rollouts(model, prompts, 7, generator=torch.Generator().manual_seed(1))
    assert roll.tokens.shape == (3, 12) and roll.mask.shape == roll.logprobs.shape == (3, 11)
    assert torch.equal(roll.tokens[:, :5], prompts)
    assert roll.mask[:, :4].sum() == 0 and roll.mask[:, 4:].min() == 1
    with torch.no_grad():
        full = distill.token_logprobs(model, roll.tokens)
    torch.testing.assert_close(roll.logprobs, full * roll.mask, atol=1e-5, rtol=1e-5)  # KV cache = full forward
    again = distill.sample_rollouts(model, prompts, 7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.tokens, roll.tokens), "the same generator seed gives the same samples"


def test_stop_token_pads_and_masks_the_rest():
    model = tiny(1)
    with torch.no_grad():
        model.output.weight.zero_()
        model.output.weight[3] = 0  # uniform distribution: token 3 appears quickly
    prompts = torch.zeros(8, 2, dtype=torch.long)
    roll = distill.sample_rollouts(model, prompts, 40, stop_token=3, generator=torch.Generator().manual_seed(0))
    completion, mask = roll.tokens[:, 2:], roll.mask[:, 1:]
    for row in range(8):
        stops = (completion[row] == 3).nonzero()
        if len(stops):
            first = stops[0].item()
            assert mask[row, : first + 1].min() == 1, "tokens up to and including the stop token are learned from"
            assert mask[row, first + 1 :].sum() == 0 and (completion[row, first:] == 3).all(), "after the stop: padding"
            assert roll.logprobs[row, 1 + first + 1 :].abs().sum() == 0
    assert mask.sum() < mask.numel(), "with a uniform 32-token vocabulary some row stops within 40 tokens"


def test_teacher_equal_to_student_gives_zero_advantages():
    model = tiny(2, sharpen=10)
    prompts = torch.randint(0, V, (4, 3), generator=torch.Generator().manual_seed(2))
    roll = distill.sample_rollouts(model, prompts, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lp = distill.token_logprobs(model, roll.tokens)
    assert distill.reverse_kl_advantages(lp, lp, roll.mask).abs().max() == 0
    assert distill.sparse_advantages(lp, lp, roll.mask).abs().max() == 0


def test_advantages_are_negative_reverse_kl_on_completion_tokens_only():
    s, t = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-3.0, -1.0, -0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    torch.testing.assert_close(distill.reverse_kl_advantages(s, t, mask, coef=2.0), torch.tensor([[0.0, 2.0, 0.0]]))
    sparse = distill.sparse_advantages(torch.zeros(2, 3), -torch.tensor([[1.0, 1, 1], [3, 3, 0]]), torch.tensor([[1.0, 1, 1], [1, 1, 0]]))
    torch.testing.assert_close(sparse, torch.tensor([[1.0, 1, 1], [-1, -1, 0]]))  # rewards -1, -3; baseline -2


def test_importance_sampling_loss_is_an_unbiased_reverse_kl_gradient():
    """Σ_x π_S(x)·∇ loss(x) over every possible sampled token = ∇ KL(π_S‖π_T)."""
    z, t = random_logits(V, seed=11).requires_grad_(), random_logits(V, seed=12)
    log_t = F.log_softmax(t, -1)
    p_s = F.softmax(z.detach(), -1)
    expected = torch.zeros(V)
    for x in range(V):
        new = F.log_softmax(z, -1)[x].view(1, 1)
        old = new.detach()
        adv = distill.reverse_kl_advantages(old, log_t[x].view(1, 1), torch.ones(1, 1))
        (grad,) = torch.autograd.grad(distill.importance_sampling_loss(new, old, adv, torch.ones(1, 1)), z)
        expected += p_s[x] * grad
    (want,) = torch.autograd.grad(distill.reverse_kl(z, t), z)
    torch.testing.assert_close(expected, want, atol=1e-5, rtol=1e-4)


def test_importance_sampling_loss_ignores_padding_and_weights_by_ratio():
    new, old = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -2.0, -2.0]])
    adv, mask = torch.tensor([[5.0, 1.0, 3.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    loss = distill.importance_sampling_loss(new, old, adv, mask)
    assert loss.item() == pytest.approx(-(math.e * 1.0 + 1.0 * 3.0) / 2)
    padded = distill.importance_sampling_loss(torch.tensor([[9.0, -1.0, -2.0]]), old, adv, mask)
    assert padded.item() == loss.item()


def test_on_policy_step_counts_compute():
    student, teacher = tiny(3), tiny(4, sharpen=20)
    compute = distill.Compute()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    prompts = torch.randint(0, V, (4, 3), generator=torch.Generator().manual_seed(4))
    distill.on_policy_step(student, teacher, opt, prompts, 5, generator=torch.Generator().manual_seed(5), compute=compute)
    c = student.cfg
    assert compute.generated_tokens == 20 and compute.sequential_calls == 5
    assert compute.student_tokens == 4 * 8 and compute.teacher_tokens == 4 * 7 and compute.trained_tokens == 4 * 7
    want = 4 * 8 * c.flops_per_token(8) + 4 * 7 * teacher.cfg.flops_per_token(7) + 3 * 4 * 7 * c.flops_per_token(7)
    assert compute.flops == want


def test_exposure_bias_vanishes_when_student_is_teacher():
    model = tiny(5, sharpen=10)
    prompts = torch.randint(0, V, (4, 3), generator=torch.Generator().manual_seed(6))
    out = distill.exposure_bias(model, model, prompts, 6)
    for name in ("teacher_prefix", "own_prefix"):
        assert out[name]["reverse_kl"].shape == (6,) and out[name]["reverse_kl"].abs().max() < 1e-5
    # the same writer and seed: both conditions see the same text
    torch.testing.assert_close(out["teacher_prefix"]["teacher_logprob"], out["own_prefix"]["teacher_logprob"])


def test_bad_inputs_raise_clear_errors():
    model = tiny(6)
    with pytest.raises(ValueError, match="temperature"):
        distill.soft_labels(torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match="prompts"):
        distill.sample_rollouts(model, torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="shapes differ"):
        distill.forward_kl(torch.zeros(2, V), torch.zeros(3, V))
    with pytest.raises(ValueError, match="method"):
        distill.train(model, model, torch.arange(100) % V, torch.zeros(1, 2, dtype=torch.long), method="magic")
    with pytest.raises(ValueError, match="signal"):
        distill.on_policy_step(model, model, None, torch.zeros(1, 2, dtype=torch.long), 2, signal="loud")


# ---------------------------------------------------------------- the loop


def test_on_policy_loop_lowers_held_out_reverse_kl():
    student, teacher = tiny(7), tiny(8, sharpen=10)
    data = torch.randint(0, V, (2000,), generator=torch.Generator().manual_seed(7))
    held_out = torch.randint(0, V, (32, 4), generator=torch.Generator().manual_seed(8))
    history = distill.train(student, teacher, data, held_out, "on_policy", steps=15, batch_size=64, prompt_len=4,
                            max_new_tokens=6, lr=1e-2, eval_every=15, seed=0, progress=False)
    before, after = history[0]["reverse_kl"], history[-1]["reverse_kl"]
    assert after < 0.6 * before, f"on-policy distillation should lower the held-out reverse KL: {before:.3f} -> {after:.3f}"
    assert history[-1]["generated_tokens"] == 15 * 64 * 6


def test_full_vocab_signal_is_zero_when_student_is_teacher_and_learns_otherwise():
    model = tiny(9, sharpen=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prompts = torch.randint(0, V, (4, 3), generator=torch.Generator().manual_seed(9))
    out = distill.on_policy_step(model, copy.deepcopy(model), opt, prompts, 5, signal="full",
                                 generator=torch.Generator().manual_seed(0))
    assert abs(out["loss"]) < 1e-6 and abs(out["sampled_reverse_kl"]) < 1e-5
    assert all(p.grad is None or p.grad.abs().max() < 1e-5 for p in model.parameters())


# ---------------------------------------------------------------- self-distillation


def test_born_again_trains_both_students_from_one_init_on_the_same_batches():
    teacher = tiny(10, sharpen=3)
    ids = torch.randint(0, V, (3000,), generator=torch.Generator().manual_seed(10))
    train_ids, val_ids = ids[:2500], ids[2500:]
    out = distill.born_again(teacher, train_ids, val_ids, steps=4, eval_every=2, seq_len=16, progress=False)
    labels, taught = out["labels"], out["labels + teacher"]
    assert [s for s, _ in labels] == [s for s, _ in taught] == [0, 2, 4]
    assert labels[0][1] == taught[0][1], "both students start from the same weights"
    assert labels[-1][1] != taught[-1][1], "the teacher's soft labels change what the student learns"
    # alpha = 0 is training on the labels alone: the same run twice
    plain = distill.born_again(teacher, train_ids, val_ids, steps=4, alpha=0.0, eval_every=2, seq_len=16, progress=False)
    assert plain["labels"] == plain["labels + teacher"] == labels
    with pytest.raises(ValueError, match="alpha"):
        distill.born_again(teacher, train_ids, val_ids, alpha=1.5)


# ---------------------------------------------------------------- a real teacher: the layer-dropped student


def test_layer_dropped_student_keeps_the_chosen_layers():
    from llmsys.distill import chat as distill_chat

    teacher = Transformer(ModelConfig(vocab_size=V, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, max_seq_len=64,
                                      tie_embeddings=True)).eval()
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    every = distill_chat.layer_dropped(teacher, keep=(0, 1, 2, 3))
    with torch.no_grad():  # the same weights through the same kernels: bitwise equal
        assert torch.equal(every(x), teacher(x))
    student = distill_chat.layer_dropped(teacher, keep=(0, 3))
    assert student.cfg.n_layers == 2
    torch.testing.assert_close(student.layers[1].attention.wq.weight, teacher.layers[3].attention.wq.weight, rtol=0, atol=0)
    assert student.output.weight is student.tok_embeddings.weight  # still tied
    state = distill_chat.trained_state(student)
    assert "tok_embeddings.weight" not in state and "layers.1.feed_forward.w2.weight" in state
    for bad in [(), (3, 0), (0, 4), (1, 1)]:
        with pytest.raises(ValueError, match="keep"):
            distill_chat.layer_dropped(teacher, keep=bad)


def test_teacher_answers_are_greedy_and_masked_after_the_stop_token():
    from llmsys.distill import chat as distill_chat

    teacher = tiny(11, sharpen=10)
    prompts = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(11))
    greedy = teacher.generate(prompts, 8)
    stop = int(greedy[0, 7])  # a token the first row says at its third new position (or earlier)
    compute = distill.Compute()
    answers = distill_chat.teacher_answers(teacher, prompts, 8, stop_token=stop, compute=compute)
    assert torch.equal(answers.tokens, greedy)
    for row in range(3):
        said = (greedy[row, 5:] == stop).nonzero()
        alive = 8 if len(said) == 0 else int(said[0]) + 1  # up to and including the first stop
        assert answers.mask[row, 4:].tolist() == [1.0] * alive + [0.0] * (8 - alive)
        assert answers.mask[row, :4].sum() == 0
    assert compute.generated_tokens == 3 * 8 and compute.teacher_tokens == 3 * 13


def test_on_policy_training_spends_the_sequence_kd_budget():
    from llmsys.distill import chat as distill_chat

    teacher = tiny(12, sharpen=10)
    prompts = torch.randint(0, V, (6, 4), generator=torch.Generator().manual_seed(12))
    seq_kd = distill_chat.layer_dropped(teacher, (0,))
    compute, losses = distill_chat.train_seq_kd(seq_kd, teacher, prompts, stop_token=V - 1, epochs=2, batch_size=4,
                                                new_tokens=6)
    assert len(losses) == 4 and compute.trained_tokens == 2 * 6 * 9
    on = distill_chat.layer_dropped(teacher, (0,))
    spent, kls = distill_chat.train_on_policy(on, teacher, prompts, V - 1, compute.flops, batch_size=4, new_tokens=6)
    per_step = spent.flops / len(kls)
    assert compute.flops <= spent.flops < compute.flops + per_step + 1e-6, "stops at the first step past the budget"
    assert on.tok_embeddings.weight.equal(teacher.tok_embeddings.weight), "the shared embedding stays frozen"
    assert not on.layers[0].attention.wq.weight.equal(teacher.layers[0].attention.wq.weight)


def test_smollm2_student_entry_loads_and_distillation_helped():
    """The zoo's cached students of SmolLM2 (built by ``python -m llmsys zoo``): the teacher's
    embedding, six of its layers; sequence-level KD brings the held-out perplexity far below the
    untrained student's. (On-policy from a broken student is what the chapter measures, not a
    given: its samples start as noise.)"""
    from llmsys.distill import chat as distill_chat
    from llmsys.core import zoo
    from llmsys.compress.measure import perplexity, windows

    teacher = zoo.load(zoo.PRETRAINED, device="cpu")
    students = distill_chat.load_students(teacher, progress=False)
    assert set(students) == {"layer_dropped", "seq_kd", "on_policy"}
    text = windows("heldout", 1, seq_len=64)
    ppl = {name: perplexity(s, text) for name, s in students.items()}
    for name, student in students.items():
        assert student.cfg.n_layers == len(distill_chat.KEEP)
        assert student.tok_embeddings.weight.equal(teacher.tok_embeddings.weight)
    assert ppl["seq_kd"] < 0.5 * ppl["layer_dropped"], ppl
    trained = distill_chat.trained_state(students["on_policy"])
    untrained = distill_chat.trained_state(students["layer_dropped"])
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert any(not trained[k].equal(untrained[k]) for k in trained), "the on-policy student was trained"
    tok = zoo.tokenizer(zoo.PRETRAINED)
    held_out = distill_chat.chat_prompts(tok, "heldout", 3)
    assert held_out.shape[0] == 3 and (held_out[:, -1] == held_out[0, -1]).all(), "left-padded: every prompt ends alike"
    for split, n in [("test", 3), ("heldout", 99)]:
        with pytest.raises(ValueError, match="split|prompts"):
            distill_chat.chat_prompts(tok, split, n)
    manifest = distill_chat.entry(progress=False)[1]["metrics"]
    assert manifest["on_policy"]["flops"] >= manifest["seq_kd"]["flops"], "equal compute: on-policy spends at least seq-KD's"

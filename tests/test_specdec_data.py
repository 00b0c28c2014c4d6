"""The EAGLE head's training data at scale: answers served by the continuous-batching engine equal
the target's greedy decoding; one teacher-forced pass gives the hidden states decoding computed
(and an off-by-one pass does not); the prompt pool, its held-out part and the size option; the
acceptance-vs-data benchmark end to end at its tiny size."""

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

from llmsys.core import pretrained, zoo
from llmsys.core.model import ModelConfig, Transformer
from llmsys.specdec import agentic, chat, eagle_data


def random_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.output.weight.mul_(8.0)  # peaked distributions: greedy paths far from ties
    return model


def prompts_of(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (1, n), generator=gen) for n in lengths]


@pytest.fixture(scope="module")
def smollm2():
    return zoo.load(zoo.PRETRAINED, device="cpu"), zoo.tokenizer(zoo.PRETRAINED)


def test_teacher_forced_features_are_the_hidden_states_decoding_computed():
    target = random_model()
    prompts = prompts_of([3, 7, 5])
    sequences, recorded = [], []
    for p in prompts:  # one at a time: no padding in the recorded run
        tokens, features = chat.self_distilled(target, p, 9, batch_size=1, progress=False)
        sequences.append(target.generate(p, 9)[0].tolist())
        assert tokens[0].tolist() == sequences[-1][:-1]
        recorded.append(features[0])
    keep = 10
    tokens, features = eagle_data.teacher_forced(target, sequences, keep, batch_size=3)  # right-padded batch
    for i, seq in enumerate(sequences):
        assert tokens[i].tolist() == seq[-keep - 1:-1]
        torch.testing.assert_close(features[i], recorded[i][-keep:], atol=1e-5, rtol=1e-5)
        # the wrong windows: the pass over the whole sequence (last token read too), or features one step late
        with torch.no_grad():
            whole = target(torch.tensor([seq]), return_hidden=True)[1][0]
        for wrong in (whole[-keep:], recorded[i][-keep - 1:-1]):
            with pytest.raises(AssertionError):
                torch.testing.assert_close(wrong, recorded[i][-keep:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shorter than every sequence"):
        eagle_data.teacher_forced(target, sequences, len(sequences[0]))


def test_engine_answers_equal_greedy_decoding_under_continuous_batching():
    target = random_model(seed=1)
    prompts = prompts_of([4, 9, 2, 6, 5], seed=4)  # 5 prompts, 2 at a time: later ones join as others finish
    answers = eagle_data.engine_answers(target, prompts, 12, batch_size=2)
    for p, got in zip(prompts, answers):
        assert got == target.generate(p, 12)[0].tolist()
    with pytest.raises(ValueError, match="batch_size"):
        eagle_data.engine_answers(target, prompts, 12, batch_size=0)


def test_engine_answers_of_smollm2_equal_its_greedy_decoding_in_fp32(smollm2):
    target, tok = smollm2
    prompts = [pretrained.chat_ids(tok, chat.EVAL_PROMPTS[0]), pretrained.chat_ids(tok, eagle_data.chat_messages()[5]),
               pretrained.chat_ids(tok, eagle_data.code_messages()[0])]  # chat and a long coding prompt
    answers = eagle_data.engine_answers(target, prompts, 10)
    for p, got in zip(prompts, answers):
        assert got == target.generate(p, 10)[0].tolist()


def test_the_prompt_pool_mixes_chat_and_code_and_keeps_the_measured_tasks_out(smollm2):
    _, tok = smollm2
    tasks = eagle_data.code_tasks()
    measured = {(m, f) for m, f, _, _ in agentic.CODE_TASKS}
    assert len(tasks) >= 100 and not measured & {(m, f) for m, f, _, _ in tasks}
    pool = eagle_data.training_prompts(tok)
    assert len(pool) == len(eagle_data.chat_messages()) + len(tasks)
    assert [p.tolist() for p in pool[:5]] == [p.tolist() for p in eagle_data.training_prompts(tok)[:5]]  # fixed order
    first = pool[:chat.DEFAULT_SEQUENCES]
    system = tok(agentic.SYSTEM)["input_ids"][:8]
    code = sum(any(p[0, i:i + 8].tolist() == system for i in range(p.size(1) - 8)) for p in first)
    assert 0.15 < code / len(first) < 0.45  # the default size sees code in the pool's proportion (~29%)
    with pytest.raises(ValueError, match="the pool"):
        chat.distilled_data(None, tok, len(pool))  # the held-out prompts cannot be trained on


def test_a_larger_head_is_its_own_zoo_entry_with_steps_in_proportion():
    assert chat.entry_name() == chat.NAME and chat.entry_name(568) == f"{chat.NAME}-568"
    assert chat.entry_hash() != chat.entry_hash(568)
    assert chat.eagle_spec(chat.DEFAULT_SEQUENCES) == chat.SPEC
    assert chat.eagle_spec(2 * chat.DEFAULT_SEQUENCES).steps == 2 * chat.SPEC.steps


def test_the_data_benchmark_writes_a_curve_at_its_tiny_size(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "eagle_data_benchmark", Path(__file__).resolve().parent.parent / "benchmarks" / "eagle_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "eagle_data.json"
    module.main(["--tiny", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["command"].startswith("python benchmarks/eagle_data.py") and {"machine", "date"} <= set(result)
    curve = result["curve"]
    assert len(curve) >= 4 and all(a["answer_tokens"] < b["answer_tokens"] for a, b in itertools.pairwise(curve))
    for point in curve:
        for workload in ("chat", "agentic"):
            row = point[workload]
            assert row["lossless"] and 0 <= row["alpha"] <= 1 and row["tokens_per_call"] >= 1
    assert result["speed"]["ratio"] > 0 and result["reading"]
    with pytest.raises(SystemExit):
        module.main(["--sizes", "96", "192", "--json", str(path)])  # fewer than 4 sizes

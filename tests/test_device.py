"""llmsys.core.device: generators where the tensors are, and which backend launched workers get."""

import pytest
import torch

from llmsys.core import device
from llmsys.core.model import sample


def pretend_gpus(monkeypatch, n: int) -> None:
    """Make this CPU machine look like one with ``n`` CUDA devices to the code that asks."""
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "pretend GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_generator_lives_on_the_device_of_what_it_samples():
    logits = torch.randn(3, 10)
    module = torch.nn.Linear(2, 2)
    for like in (logits, module, "cpu", torch.device("cpu")):
        assert device.generator(0, like).device == torch.device("cpu")
    draws = [sample(logits, 1.0, generator=device.generator(7, logits)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])  # the seed fixes the draw


def test_a_cuda_generator_is_refused_where_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device"):
        device.generator(0, "cuda")
    with pytest.raises(ValueError, match="no parameters or buffers"):
        device.generator(0, torch.nn.ReLU())


def test_sample_refuses_a_generator_on_another_device():
    # 'meta' stands in for a GPU: a CPU generator cannot draw for logits elsewhere (torch raises on CUDA).
    logits = torch.zeros(2, 5, device="meta")
    with pytest.raises(ValueError, match="llmsys.core.device.generator"):
        sample(logits, 1.0, generator=torch.Generator())
    assert sample(logits, 0.0, generator=torch.Generator()).shape == (2, 1)  # greedy draws nothing


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_cpu_tensor_workers_get_gloo_on_any_machine(monkeypatch, gpus):
    if gpus:
        pretend_gpus(monkeypatch, gpus)
    assert device.dist_backend(2) == "gloo"
    assert device.dist_backend(2, accelerator=True) == ("nccl" if gpus >= 2 else "gloo")
    assert device.dist_backend(1, accelerator=True) == ("nccl" if gpus >= 1 else "gloo")


def test_summary_names_nccl_on_a_one_gpu_machine(monkeypatch):
    pretend_gpus(monkeypatch, 1)
    backend = device.summary()["distributed backend"]
    assert "nccl" in backend and "up to 1 rank" in backend and "gloo for CPU-tensor workers" in backend
    monkeypatch.undo()
    if not torch.cuda.is_available():
        assert device.summary()["distributed backend"] == "gloo (no GPU)"

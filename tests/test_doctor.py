"""python -m llmsys doctor: one line per step, failures do not stop it, GPU steps skipped (and why) on a CPU."""

import sys

import pytest
import torch

from llmsys.__main__ import main
from llmsys.course import doctor

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU machine reports")


def command(argv):
    return lambda context: argv


def test_a_failure_or_a_timeout_does_not_stop_the_steps_after_it(tmp_path):
    steps = [
        doctor.Step("fails", "exits 3", command([sys.executable, "-c", "print('about to fail'); raise SystemExit(3)"]), 60),
        doctor.Step("hangs", "sleeps past its limit", command([sys.executable, "-c", "import time; time.sleep(60)"]), 1),
        doctor.Step("skips", "not here", lambda context: "no CUDA device: nothing to measure", 60),
        doctor.Step("passes", "prints", command([sys.executable, "-c", "print('fine')"]), 60),
        doctor.Step("wrong output", "runs but shows the wrong thing", command([sys.executable, "-c", "print('gloo')"]),
                    60, lambda context, log: None if "nccl" in log else "expected nccl"),
    ]
    lines = []
    outcomes = doctor.run(tmp_path, steps=steps, say=lines.append)
    assert [(o.step, o.status) for o in outcomes] == [("fails", "FAILED"), ("hangs", "FAILED"), ("skips", "skipped"),
                                                       ("passes", "ok"), ("wrong output", "FAILED")]
    assert "exit code 3: about to fail" in outcomes[0].detail
    assert "timed out after 1 s" in outcomes[1].detail
    assert outcomes[2].detail == "no CUDA device: nothing to measure"
    assert "expected nccl" in outcomes[4].detail
    assert (tmp_path / "passes.log").read_text().splitlines()[-1] == "fine"
    summary = (tmp_path / "summary.txt").read_text()
    assert "1 ok, 3 FAILED, 1 skipped" in summary and all(o.line() in summary for o in outcomes)
    assert all(o.line() in lines for o in outcomes)
    # --gpu: a step skipped for want of a GPU is a failure instead
    assert doctor.run_step(steps[2], doctor.Context(doctor.found(), tmp_path), require_gpu=True).status == "FAILED"


@no_gpu
def test_doctor_on_a_cpu_runs_what_applies_and_says_what_it_skipped(tmp_path, capsys):
    steps = ["info", "triton-after-byte-count", "kernel-bench", "notebook-gpu-cells"]
    assert main(["doctor", "--out", str(tmp_path), "--steps", *steps]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in steps}
    for ran in ("info", "triton-after-byte-count"):
        assert lines[ran].split()[1] == "ok", lines[ran]
    for skipped in ("kernel-bench", "notebook-gpu-cells"):
        assert lines[skipped].split()[1] == "skipped" and "no CUDA device:" in lines[skipped], lines[skipped]
    assert "triton.language is intact" in (tmp_path / "triton-after-byte-count.log").read_text()
    assert "GPU cells: " in (tmp_path / "info.log").read_text()
    assert "2 ok, 0 FAILED, 2 skipped" in out


@no_gpu
def test_doctor_gpu_flag_fails_without_a_gpu_and_unknown_steps_are_refused(tmp_path, capsys):
    assert main(["doctor", "--gpu", "--out", str(tmp_path), "--steps", "kernel-bench"]) == 1
    out = capsys.readouterr().out
    assert "no CUDA device found" in out and "kernel-bench" in out and "FAILED" in out
    assert main(["doctor", "--out", str(tmp_path), "--steps", "kernels"]) == 2
    assert "unknown step(s) ['kernels']" in capsys.readouterr().err


def test_chapter_readiness_follows_what_was_found():
    facts = doctor.found()
    gpu_server = {**facts, "gpus": ["NVIDIA H200"], "nccl": True, "triton mode": "compiled", "bitsandbytes": None}
    how = {number: text for number, _, _, text in doctor.chapter_readiness(gpu_server)}
    assert how[0] == how[1] == how[4] == "run on this GPU"
    assert "needs bitsandbytes" in how[3] and how[7] == "no GPU cells"
    assert "needs bitsandbytes" in dict((n, h) for n, _, _, h in doctor.chapter_readiness({**facts, "bitsandbytes": None}))[3]
    no_triton = {**gpu_server, "triton mode": "unavailable", "nccl": False}
    how = {number: text for number, _, _, text in doctor.chapter_readiness(no_triton)}
    assert how[0] == how[8] == "cannot run: needs triton" and how[1] == "cannot run: needs nccl"
    chapter_9 = [text for number, _, _, text in doctor.chapter_readiness(no_triton) if number == 9]
    assert chapter_9 == ["cannot run: needs triton", "cannot run: needs nccl"]  # each notebook its own needs
    if not facts["gpus"]:
        assert all("no GPU" in text for number, _, _, text in doctor.chapter_readiness(facts) if number != 7)

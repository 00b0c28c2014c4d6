"""Calibration: does a model's confidence match how often it is right?

Guo et al. 2017, "On Calibration of Modern Neural Networks" (arXiv 1706.04599):
expected calibration error ECE = Σ_b (|B_b| / n) · |acc(B_b) − conf(B_b)| over equal-width
confidence bins; a reliability diagram plots acc(B_b) against conf(B_b). Temperature
scaling divides the logits by one scalar T > 0 fitted to minimise the negative
log-likelihood on held-out (dev) data; it never changes the argmax, so accuracy stays and
only confidence moves. HELM reports calibration as a first-class metric next to accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _check(logits: torch.Tensor, labels: torch.Tensor):
    logits, labels = torch.as_tensor(logits, dtype=torch.float64), torch.as_tensor(labels)
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"need logits (N, C) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if len(labels) == 0:
        raise ValueError("no items: calibration needs at least one prediction")
    return logits, labels.long()


@dataclass
class Reliability:
    """Per-bin data of a reliability diagram (bins with no items have count 0 and NaN acc/conf)."""

    edges: list[float]
    confidence: list[float]
    accuracy: list[float]
    count: list[int]


def reliability(confidence, correct, n_bins: int = 10) -> Reliability:
    """Bin predictions by confidence into ``n_bins`` equal-width bins (lower edge open, like Guo et al.)."""
    confidence = torch.as_tensor(confidence, dtype=torch.float64)
    correct = torch.as_tensor(correct, dtype=torch.float64)
    if confidence.shape != correct.shape or confidence.dim() != 1:
        raise ValueError("confidence and correct must be 1-D and of equal length")
    if ((confidence < 0) | (confidence > 1)).any():
        raise ValueError("confidences must lie in [0, 1]")
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    # bin b holds (edges[b], edges[b+1]]; a confidence of exactly 0 goes to the first bin
    index = (torch.bucketize(confidence, edges) - 1).clamp(0, n_bins - 1)
    conf, acc, count = [], [], []
    for b in range(n_bins):
        mask = index == b
        count.append(int(mask.sum()))
        conf.append(confidence[mask].mean().item() if mask.any() else math.nan)
        acc.append(correct[mask].mean().item() if mask.any() else math.nan)
    return Reliability(edges.tolist(), conf, acc, count)


def ece(confidence, correct, n_bins: int = 10) -> float:
    """Expected calibration error: the count-weighted mean gap |accuracy − confidence| over bins."""
    r = reliability(confidence, correct, n_bins)
    n = sum(r.count)
    return sum(c / n * abs(a - p) for c, a, p in zip(r.count, r.accuracy, r.confidence) if c)


def confidence_and_correct(logits, labels, temperature: float = 1.0):
    """Top-class probability of softmax(logits / T) and whether that class is the label."""
    logits, labels = _check(logits, labels)
    probs = F.softmax(logits / temperature, dim=-1)
    confidence, prediction = probs.max(dim=-1)
    return confidence, (prediction == labels).double()


def nll(logits, labels, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the labels under softmax(logits / T)."""
    logits, labels = _check(logits, labels)
    return F.cross_entropy(logits / temperature, labels).item()


def fit_temperature(logits, labels, max_iter: int = 100) -> float:
    """The T > 0 that minimises the NLL of softmax(logits / T) on (dev) data; LBFGS on log T."""
    logits, labels = _check(logits, labels)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return log_t.exp().item()


def calibration_table(dev_logits, dev_labels, test_logits, test_labels, n_bins: int = 10) -> list[dict]:
    """Rows (before / after temperature scaling) of accuracy, mean confidence, ECE and NLL on test,
    the temperature fitted on dev."""
    t = fit_temperature(dev_logits, dev_labels)
    rows = []
    for name, temperature in (("uncalibrated", 1.0), ("temperature scaled", t)):
        conf, correct = confidence_and_correct(test_logits, test_labels, temperature)
        rows.append({"method": name, "T": temperature, "acc": correct.mean().item(), "confidence": conf.mean().item(),
                     "ece": ece(conf, correct, n_bins), "nll": nll(test_logits, test_labels, temperature)})
    return rows

"""Chapter 11, evaluation: tasks built from the standard library, log-likelihood scoring as
lm-evaluation-harness does it, calibration, uncertainty and hallucination detection,
benchmark contamination."""

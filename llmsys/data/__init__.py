"""Chapter 11, data: exact and near-duplicate detection (MinHash + LSH), quality filters,
data mixing and duplication experiments on tiny models."""

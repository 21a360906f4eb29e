"""Load generators and benchmarks that work against any OpenAI-compatible endpoint."""

"""OpenAI-compatible HTTP server: `tokenweir serve` (see tokenweir.server.cli)."""

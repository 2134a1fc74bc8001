"""The HTTP server: an OpenAI-compatible gateway over the serving engine (`qladder serve`)."""

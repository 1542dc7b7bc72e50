"""loadgen: open-loop load generator for OpenAI-style endpoints (metrics as in vLLM bench serve)."""

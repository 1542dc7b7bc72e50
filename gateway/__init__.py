"""The gateway process: OpenAI-style HTTP API in front of the Redis queue and the engines."""

"""Shared core of flying-serving: Redis key schema, cross-process messages, the Redis queue, settings."""

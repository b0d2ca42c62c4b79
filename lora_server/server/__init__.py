"""The HTTP edge: the OpenAI-compatible app, its request models, metrics, and ``lora-server serve``."""

"""PEFT LoRA adapters: reading, validation and conversion to the kernel layout (the multi-LoRA issue)."""

"""LoRA adapters (--enable-lora): PEFT directories loaded into host memory (adapter.py), a pool of
--max-loras-per-batch slots they are copied into on demand (slots.py), the segmented product a batch applies
(batch.py) and the manager the engine and the HTTP side use (manager.py)."""

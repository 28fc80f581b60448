"""The projections a LoRA adapter may target (torch-free: the config names them)."""

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

"""Adapter tensor formats: which tensors of adapter_model.safetensors adapt which of the model's LoRA targets
(lora/targets.py), told apart by their names and shapes. lora/adapter.py asks the expert formats first
(experts.py: PEFT target_parameters on fused experts, per-expert modules, stacked 3-D tensors), then PEFT's
per-module tensors take the rest (dense.py). A tensor no format understands is refused by name.
"""

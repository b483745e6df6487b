"""sapo_megatron: SAPO RL post-training of MoE LLMs on Megatron-Core."""

__version__ = "0.1.0"

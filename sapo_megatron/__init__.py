"""sapo_megatron: SAPO RL post-training of MoE LLMs on Megatron-Core."""

__version__ = "0.1.0"

from sapo_megatron import _moved

_moved.install()

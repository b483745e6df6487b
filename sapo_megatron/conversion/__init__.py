"""HF ⇄ Megatron checkpoint conversion and its ``convert`` CLI. Above ``sapo_megatron.megatron`` in the layout:
conversion builds Megatron models (``megatron/``) and reads and writes through ``checkpoint/`` (the mapping
table, streaming safetensors, atomic publishing), which imports neither."""

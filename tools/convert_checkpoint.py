"""HF ⇄ Megatron checkpoint conversion (same as ``sapo-megatron convert …``).

python tools/convert_checkpoint.py hf-to-megatron --hf Qwen3-30B-A3B --out ckpt/qwen3-30b-a3b-mcore
python tools/convert_checkpoint.py megatron-to-hf --megatron runs/x/checkpoints --out export --hf-reference Qwen3-30B-A3B
python tools/convert_checkpoint.py verify --hf Qwen3-30B-A3B --megatron ckpt/qwen3-30b-a3b-mcore
"""

import sys

from sapo_megatron.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))

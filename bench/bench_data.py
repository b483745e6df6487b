"""The dry run's data check on a large verl parquet: generate N rows (default 100,000) in verl's layout and the
tests' BPE tokenizer with a Qwen-style chat template in a temporary directory (nothing is kept), then run
``train configs/recipes/saf_deepmath_qwen3_4b.yaml --dry-run`` on them, which prints the time it took to read and
validate every row's schema and to render and measure every prompt.

    python bench/bench_data.py [--rows 100000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sapo_megatron.cli import main  # noqa: E402
from tests.data.chat_fixtures import make_chat_tokenizer, write_verl_parquet  # noqa: E402


def run(rows: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_verl_parquet(
            root / "train.parquet", rows, sources=("deepmath", "aime", "math", "olympiad")
        )
        tokenizer = make_chat_tokenizer(root / "tokenizer")
        (root / "init").mkdir()
        sets = [
            f"data.train={data}",
            "eval.datasets=[]",
            f"data.tokenizer={tokenizer}",
            f"model.init_path={root / 'init'}",
        ]
        recipe = REPO / "configs" / "recipes" / "saf_deepmath_qwen3_4b.yaml"
        return main(["train", str(recipe), "--dry-run", *[a for s in sets for a in ("--set", s)]])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    sys.exit(run(args.rows))

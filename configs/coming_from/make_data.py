"""Writes the example datasets of docs/coming_from.md (deterministic): the same 16 word problems in verl's parquet
layout, slime's jsonl keys and a TRL conversational jsonl. Run from the repository root:
``python configs/coming_from/make_data.py``."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "data"


def problems() -> list[tuple[str, int, str]]:
    out = []
    for i in range(16):
        a, b = 3 * i + 2, 5 * i + 7
        question = f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?"
        out.append((question, a + b, f"{a} + {b} = {a + b}\n#### {a + b}"))
    return out


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    HERE.mkdir(parents=True, exist_ok=True)
    instruction = ' Let\'s think step by step and output the final answer after "####".'
    verl = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": q + instruction}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": "train", "index": i, "answer": solution, "question": q},
        }
        for i, (q, answer, solution) in enumerate(problems())
    ]
    pq.write_table(pa.Table.from_pylist(verl), HERE / "gsm8k_verl.parquet")
    slime = [
        {"question": q, "answer": str(answer), "metadata": {"id": i}}
        for i, (q, answer, _) in enumerate(problems())
    ]
    (HERE / "math_slime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slime))
    trl = [
        {"prompt": [{"role": "user", "content": q}], "solution": str(answer), "level": 1 + i % 3}
        for i, (q, answer, _) in enumerate(problems())
    ]
    (HERE / "math_trl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trl))


if __name__ == "__main__":
    main()

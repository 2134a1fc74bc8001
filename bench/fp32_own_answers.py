"""Full precision's own greedy answers, scored by itself: the judge's test of "fp32 is never garbage".

    .venv/bin/python bench/fp32_own_answers.py [--per-class 10] [--max-tokens 128] [--threads 2] OUT.jsonl

The fp32 rung alone (validate.replay.greedy, the one-sequence torch engine) answers PLAIN (plain
requests written here: poems, songs, lists, counting, questions) and the first --per-class prompts of
each normal corpus class, --max-tokens tokens, then scores each answer (its mean negative
log-likelihood under the same model). One JSON line per answer: prompt_id, prompt, token_ids, text,
nll. tests/fixtures/judge/fp32_own.jsonl is this script's output (defaults; 2 threads) and
tests/test_judge.py asserts that none of it is judged garbage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from qladder.config import Settings
from qladder.engines import load_engine
from qladder.model import inspect_model, user_prompt_ids
from qladder.validate.corpora import DEFAULT_DIR, load_corpora
from qladder.validate.garbage import mean_nll
from qladder.validate.replay import greedy

PLAIN = ["Write a short poem about the sea.", "Write a short poem about the rain.", "Write a haiku about winter.",
         "Write a poem with a refrain about home.", "Write a limerick about a cat.", "Write a short song about summer.",
         "List ten fruits.", "List the days of the week.", "List the months of the year.", "Count from 1 to 30.",
         "List five tips for better sleep.", "Name the planets of the solar system.", "What is the capital of Spain?",
         "Explain photosynthesis in one paragraph.", "Write a Python function that adds two numbers.",
         "What is 17 times 23?", "Give me a recipe for pancakes.", "Write a short story about a dragon.",
         "List the colors of the rainbow.", "Write a poem about libraries, love and loss.",
         "Write a nursery rhyme.", "Write a short poem about the moon.", "List ten animals.", "Spell the alphabet."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--per-class", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    info = inspect_model()
    fp32 = load_engine("fp32", info, dataclasses.replace(Settings.from_env(), n_threads=a.threads))
    normal, _ = load_corpora(DEFAULT_DIR)
    by_class: dict[str, list[tuple[str, str]]] = {}
    for p in normal:
        by_class.setdefault(p.cls, []).append((p.id, str(p.prompt)))
    prompts = [(f"plain-{i:02d}", q) for i, q in enumerate(PLAIN)]
    prompts += [x for v in by_class.values() for x in v[: a.per_class]]
    with open(a.out, "w", encoding="utf-8") as fh:
        for pid, text in prompts:
            ids = user_prompt_ids(info.chat_template, text, fp32.tokenize)
            answer = greedy(fp32, ids, a.max_tokens)
            row = {"prompt_id": pid, "prompt": text, "token_ids": answer, "text": fp32.detokenize(answer),
                   "nll": mean_nll(fp32.score(ids, answer))}
            fh.write(json.dumps(row, ensure_ascii=True) + "\n")
    fp32.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

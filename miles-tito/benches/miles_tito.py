"""Times Miles' own Python TITO (`miles.utils.chat_template_utils.tito_tokenizer`, the qwen3
family) on the turns `tito_turns.rs` measures, in the same run.

Usage: python miles_tito.py STATE.json
STATE.json (written by the bench): {"tokenizer_dir", "tools", "turns": [{"name", "stored",
"request", "full_ids"}]}, messages in OpenAI form, `full_ids` miles-tito's prompt ids.

Miles must be importable (its source tree and an sglang install on PYTHONPATH: the bench
passes MILES_TITO_PYTHONPATH). Prints one line per turn:
  miles_tito name=NAME incremental_ms=X full_ms=Y same_ids_as_ours=0|1 tokens=N
(medians of batches, as the Rust side times itself) after checking that Miles' merged ids equal
its own full render's. The stored ids are Miles' own render of the stored history, as its
session would hold them; `same_ids_as_ours` says whether its prompt ids equal miles-tito's.
"""

import json
import statistics
import sys
import time

from transformers import AutoTokenizer

from miles.utils.chat_template_utils.tito_tokenizer import (
    get_tito_tokenizer,
    resolve_fixed_chat_template,
)


def median_ms(batches, per_batch, f):
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            f()
        times.append((time.perf_counter() - start) * 1e3 / per_batch)
    return statistics.median(times)


def main():
    state = json.load(open(sys.argv[1]))
    tokenizer = AutoTokenizer.from_pretrained(state["tokenizer_dir"])
    # The family's fixed template, as Miles' session server installs it.
    path, _ = resolve_fixed_chat_template("qwen3")
    if path:
        tokenizer.chat_template = open(path).read()
    tito = get_tito_tokenizer(tokenizer, "qwen3")
    tools = state["tools"]
    newline = tokenizer.encode("\n", add_special_tokens=False)
    for turn in state["turns"]:
        stored, request = turn["stored"], turn["request"]
        # The ids Miles' session would hold: its own render of the stored history, ending
        # where the model stopped (on <|im_end|>, without the template's newline).
        stored_ids = list(
            tito.apply_chat_template(
                stored, add_generation_prompt=False, tools=tools, tokenize=True
            )
        )
        if stored_ids[-len(newline):] == newline:
            stored_ids = stored_ids[: -len(newline)]

        def incremental():
            return tito.merge_tokens(stored, request, stored_ids, tools)

        def full():
            return tito.apply_chat_template(
                request, add_generation_prompt=True, tools=tools, tokenize=True
            )

        merged, rendered = incremental(), list(full())
        if merged != rendered:
            sys.exit(f"{turn['name']}: Miles' merged ids differ from its full render")
        same = int(merged == turn["full_ids"])
        inc_ms = median_ms(21, 20, incremental)
        full_ms = median_ms(11, 3, full)
        print(
            f"miles_tito name={turn['name']} incremental_ms={inc_ms:.5f} "
            f"full_ms={full_ms:.5f} same_ids_as_ours={same} tokens={len(merged)}"
        )


if __name__ == "__main__":
    main()

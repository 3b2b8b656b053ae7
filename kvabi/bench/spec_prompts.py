"""The prompts of `kvabi bench spec`: input-grounded ones, whose answer copies the prompt
(edit code, extract lines, rewrite a text), and open-ended ones, whose answer does not."""

from __future__ import annotations

CODE = """def mean_and_total(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return 0, total
    return total / count, total


def report(rows):
    lines = []
    for name, values in rows:
        average, total = mean_and_total(values)
        lines.append(f"{name}: average {average:.2f}, total {total}")
    return "\\n".join(lines)
"""

LOG = """2026-11-30 10:00:01 INFO server started on port 8000
2026-11-30 10:00:04 INFO loaded model smollm2 in 1.2 s
2026-11-30 10:01:17 ERROR request 17 failed: context length 9000 exceeds 8192
2026-11-30 10:01:18 INFO request 18 finished in 0.8 s
2026-11-30 10:02:40 WARNING cache is 91% full
2026-11-30 10:03:05 ERROR request 23 failed: client disconnected
2026-11-30 10:03:06 INFO request 24 finished in 1.1 s
2026-11-30 10:04:51 ERROR redis tier unreachable, retrying in 5 s
"""

TEXT = (
    "The company was founded in 1998 in a small garage. In its first year the company sold "
    "twelve machines, all of them built by hand. By 2005 the company employed three hundred "
    "people and shipped machines to forty countries. Today the company is known for its "
    "reliable engines and its long warranty."
)

GROUNDED = (
    f"Rename the variable `total` to `running_sum` in this Python code. Reply with the whole "
    f"code and nothing else.\n\n```python\n{CODE}```",
    f"Copy every line of this log that contains ERROR, exactly as it is, one per line.\n\n{LOG}",
    f"Rewrite this text with every 'the company' replaced by 'Acme'. Keep everything else "
    f"exactly the same.\n\n{TEXT}",
    f"Add a docstring to each function of this code and reply with the whole code.\n\n"
    f"```python\n{CODE}```",
)

OPEN = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a birthday party for a friend who likes hiking.",
    "What are the main benefits of regular exercise? Answer in a few paragraphs.",
)

PROMPT_SETS = {"grounded": GROUNDED, "open": OPEN}

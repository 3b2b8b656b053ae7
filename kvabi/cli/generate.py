"""`kvabi generate` and `kvabi chat`: the engine on the command line, output streamed."""

from __future__ import annotations

import argparse
import sys

from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams


def _llm(args: argparse.Namespace) -> tuple[LLM, SamplingParams]:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(
        args.model, dtype=args.dtype, kv_layout=args.kv_layout, block_size=args.block_size
    )  # shows a progress bar while the weights load
    return llm, params


def _stream(llm: LLM, prompt: str | list[int], params: SamplingParams) -> str:
    text = []
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text.append(delta.text)
    sys.stdout.write("\n")
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    llm, params = _llm(args)
    prompt = args.prompt
    if args.chat_template:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    _stream(llm, prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm, params = _llm(args)
    history: list[dict[str, str]] = []
    print("kvabi chat: an empty line or Ctrl-D ends the conversation.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if not line:
            return 0
        history.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        history.append({"role": "assistant", "content": _stream(llm, ids, params)})

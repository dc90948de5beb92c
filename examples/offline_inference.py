"""Offline batch inference with deepinfer's vLLM-shaped API.

    python examples/offline_inference.py                      # the built-in tiny V4-Flash, random weights
    python examples/offline_inference.py --plan PLAN_DIR      # a plan from `deepinfer compile -o PLAN_DIR`

With random weights the text is noise; the point is the API: prompts as text, chat messages or token ids,
per-request SamplingParams, finish reasons, TTFT/TPOT, and streaming.
"""

import argparse

from deepinfer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="plan directory (default: compile the tiny model in memory)")
    ap.add_argument("--model", default="deepseek-v4-flash")
    args = ap.parse_args()
    llm = LLM(plan=args.plan) if args.plan else LLM(model=args.model, target="cpu")

    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],  # chat messages
        "The quick brown fox",  # raw text (no chat template)
        [0, 4, 8, 15, 16, 23, 42],  # token ids
        "",  # bad input: this request finishes with "error"; the others run
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=8, logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.1, seed=2, max_tokens=8, stop=["."]),
        SamplingParams(max_tokens=8),
    ]
    for out in llm.generate(prompts, params):
        if out.finish_reason == "error":
            print(f"[{out.index}] error: {out.error}")
            continue
        print(f"[{out.index}] {out.finish_reason}: {out.text!r} {out.token_ids}  "
              f"ttft {out.ttft_s * 1000:.0f} ms, tpot {(out.tpot_s or 0) * 1000:.0f} ms")  # fmt: skip

    print("streaming:")
    for out in llm.stream(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6)):
        print(f"  {len(out.token_ids)} tokens: {out.text!r}{' (done)' if out.finished else ''}")
    llm.close()


if __name__ == "__main__":
    main()

"""The reasoning dataset and what Qwen3-4B's template supervises in it (tests/unit/pipeline/test_reasoning.py,
tests/integration/test_reasoning_cache.py)."""
from paths import REPO

REASONING = REPO / "tests" / "fixtures" / "reasoning" / "chats.jsonl"


# what Qwen3-4B's template emits for each answer after its generation prompt
# (<|im_start|>assistant\n<think>\n), plus the end-of-turn token; earlier turns lose their reasoning
QWEN3_SUPERVISED = {
    "r1": ["5<|im_end|>", "The last answer was 5, and 5 times 4 is 20.\n</think>\n\n20<|im_end|>"],
    "r3": ["11 has no divisor but 1 and itself.\n</think>\n\n11<|im_end|>"],
    "r4": ["No: 9 = 3 * 3.<|im_end|>", "7 has no divisor but 1 and 7.\n</think>\n\nYes, 7 is prime.<|im_end|>"],
    # no reasoning: the empty think block's "\n\n" is one token that starts in the prompt's "\n"
    "r5": ["\n\n</think>\n\nok<|im_end|>"],
}
QWEN3_SUPERVISED["r2"] = QWEN3_SUPERVISED["r1"]  # inline <think> renders as reasoning_content does

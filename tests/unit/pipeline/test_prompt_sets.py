"""evaluate.prompt_sets: the five public benchmark layouts, a field mapping and chat rows, read as the
decoding loop's tasks; bad rows skipped with a reason and counted; per-task and macro tables."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.chats.render import render_prompt
from pipeline.config import RenderConfig
from pipeline.errors import ConfigError
from pipeline.eval_report import macro_average, tau_table
from pipeline.run import DEFAULT_CONFIG, check_inputs, load_config
from pipeline.stages.evaluate import eval_prompts

# a few rows of each benchmark, written for this test in the layout each is distributed in
ROWS = {
    "mt_bench": [{"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now rhyme it."]},
                 {"question_id": 82, "category": "math", "turns": ["What is 7 times 8?", "And 9 times 9?"]}],
    "gsm8k": [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
              {"answer": "#### 2"},  # no question: skipped, counted
              {"question": "A box holds 12 eggs. How many in 3 boxes?", "answer": "#### 36"}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
                   "entry_point": "add"}],
    "math500": [{"problem": "Find x if 2x + 3 = 11.", "answer": "4", "subject": "Algebra", "level": 1}],
    "mbpp": [{"task_id": 2, "text": "Write a function to find the shared elements of two lists.",
              "test_list": ["assert f([1],[1]) == [1]"]}],
}


def _sets(tmp_path):
    sets = {}
    for fmt, rows in ROWS.items():
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
        sets[fmt] = {"path": str(path), "format": fmt}
    pq.write_table(pa.Table.from_pylist([{"instruction": "Summarise: the cat sat.", "output": "x"},
                                         {"instruction": None, "output": "y"}]), tmp_path / "alpaca.parquet")
    sets["alpaca"] = {"path": str(tmp_path / "alpaca.parquet"), "format": "field", "field": "instruction"}
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                             {"role": "user", "content": "More"}]}) + "\n")
    sets["chat"] = {"path": str(chat), "format": "chat", "max_prompts": 1}
    sets["mt_math"] = {"path": str(tmp_path / "mt_bench.jsonl"), "format": "mt_bench", "match": "{category: '^math$'}"}
    return sets


def _cfg(sets, *extra):
    flat = [f"+evaluate.prompt_sets.{task}.{k}={v}" for task, spec in sets.items() for k, v in spec.items()]
    return load_config(DEFAULT_CONFIG, ["~evaluate.prompt_sets", *flat, *extra])  # without tiny.yaml's own sets


def test_each_format_reads_its_prompt_field_and_renders_it_as_a_user_turn(tmp_path, tiny_tokenizer):
    cfg = _cfg(_sets(tmp_path))
    skipped = {}
    prompts = eval_prompts(cfg, tiny_tokenizer, skipped)
    tasks = [t for t, _ in prompts]
    assert tasks == ["mt_bench"] * 2 + ["gsm8k"] * 2 + ["humaneval", "math500", "mbpp", "alpaca", "chat", "mt_math"]
    render = RenderConfig(**{"system_prompt": cfg.data.render.system_prompt})

    def user(text):
        return render_prompt(tiny_tokenizer, [{"role": "user", "content": text}], render)

    got = dict(zip(tasks, (ids for _, ids in prompts)))  # the last prompt of each task
    assert prompts[0][1] == user("Write a haiku about rain.")  # MT-Bench: the first turn
    assert got["gsm8k"] == user(ROWS["gsm8k"][2]["question"])
    assert got["humaneval"] == user(ROWS["humaneval"][0]["prompt"])
    assert got["math500"] == user("Find x if 2x + 3 = 11.")
    assert got["mbpp"] == user(ROWS["mbpp"][0]["text"])
    assert got["alpaca"] == user("Summarise: the cat sat.")
    assert got["chat"] == user("Hi")  # a chat up to its first answer
    assert got["mt_math"] == user("What is 7 times 8?")  # one benchmark file split by a field
    assert skipped["mt_math"] == {"not_in_set": 1, "invalid_json": 1}
    # every bad row skipped with its reason and counted, per task
    assert skipped["gsm8k"] == {"missing_field": 1, "invalid_json": 1}
    assert skipped["alpaca"] == {"missing_field": 1}
    assert all(skipped[f]["invalid_json"] == 1 for f in ROWS)


def test_max_prompts_and_too_long_prompts(tmp_path, tiny_tokenizer):
    sets = _sets(tmp_path)
    sets["gsm8k"]["max_prompts"] = 1
    skipped = {}
    prompts = eval_prompts(_cfg(sets, "data.max_length=12"), tiny_tokenizer, skipped)
    assert all(len(ids) < 12 for _, ids in prompts)
    assert sum(skipped.get("gsm8k", {}).values()) >= 1 and "too_long" in skipped["mbpp"]
    assert sum(1 for t, _ in eval_prompts(_cfg(sets), tiny_tokenizer) if t == "gsm8k") == 1


def test_config_errors_name_the_key_and_missing_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"evaluate\.prompt_sets\.x\.format: unknown format 'squad'"):
        _cfg({"x": {"path": "a.jsonl", "format": "squad"}})
    with pytest.raises(ConfigError, match=r"evaluate\.prompt_sets\.x\.field: format 'field' needs"):
        _cfg({"x": {"path": "a.jsonl", "format": "field"}})
    with pytest.raises(ConfigError, match=r"evaluate\.prompt_sets\.x\.match: .* in \{'id': '\('}"):
        _cfg({"x": {"path": "a.jsonl", "format": "chat", "match": "{id: '('}"}})
    with pytest.raises(ConfigError, match=r"evaluate\.prompt_sets\.x\.path: is required"):
        _cfg({"x": {"format": "gsm8k"}})
    cfg = _cfg({"gsm8k": {"path": str(tmp_path / "gone.jsonl"), "format": "gsm8k"}})
    with pytest.raises(ConfigError, match=r"evaluate\.prompt_sets\.gsm8k\.path: .*gone\.jsonl does not exist"):
        check_inputs(cfg, ["evaluate"])
    check_inputs(cfg, ["train"])  # only evaluate reads the prompt sets


def test_macro_average_and_the_per_task_table():
    tasks = {"gsm8k": {"rounds": 10, "tau": 3.0, "tau_se": 0.3}, "mbpp": {"rounds": 8, "tau": 2.0, "tau_se": 0.4},
             "empty": {"rounds": 0}}
    m = macro_average(tasks)
    assert m == {"tau": 2.5, "tau_se": pytest.approx(0.25), "tasks": 2}  # sqrt(0.09 + 0.16) / 2
    assert macro_average({"a": {"rounds": 3, "tau": 2.0, "tau_se": None}})["tau_se"] is None
    assert macro_average({"a": {"rounds": 0}}) is None
    overall = {"tau": 2.6, "tau_se": 0.2, "verified_per_round": 4.0, "tokens_per_s": 10.0, "speedup_vs_target": 1.5}
    results = {"T=0": {"target_tokens_per_s": 7.0, "drafters": {"dspark": {"overall": overall, "tasks": tasks}}}}
    table = tau_table(results, {})
    assert "| T | drafter | empty | gsm8k | mbpp | macro |" in table
    assert "| 0 | dspark | - | 3.000 ± 0.300 | 2.000 ± 0.400 | 2.500 ± 0.250 |" in table

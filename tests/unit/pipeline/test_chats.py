"""Chat ingestion: every row of tests/fixtures/cases/chats behaves as its README says."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.chats.ingest import BadRow, Chat, iter_chats, normalize_messages, RowError
from pipeline.errors import BadInputFileError

OPENAI_EXPECTED = {  # id -> None (kept) or reason code (cache stage: require_answer=True)
    "o1": None, "o2": None, "o3": None, "o4": None, "o5": "no_user_turn", "o6": "empty_answer",
    "o7": "empty_answer", "o8": "no_answer", "o9": "bad_type", "o10": "unknown_role",
    "o11": "invalid_json", "o11b": "invalid_utf8", "o12": "empty_conversation", "o13": None,
    "o14": None, "o15": "not_a_chat", "o16": None, "o18": None, "o19": None, "o20": None,
}


def _by_line(path):
    rows = list(iter_chats(str(path), source=3))
    return {r.row + 1: r for r in rows}


def test_openai_cases_line_by_line(input_cases):
    path = input_cases / "chats" / "openai.jsonl"
    got = _by_line(path)
    assert 18 not in got, "the blank line is not a row"
    assert len(got) == 20
    lines = path.read_bytes().split(b"\n")
    for line_no, item in got.items():
        assert item.source == 3 and item.path == str(path)
        raw = lines[line_no - 1]
        if b'"o11"' in raw:
            rid = "o11"
        elif b'"o11b"' in raw:
            rid = "o11b"
        else:
            rid = json.loads(raw)["id"]
        expected = OPENAI_EXPECTED[rid]
        if expected is None:
            assert isinstance(item, Chat), (rid, item)
            assert item.row_id == rid
        else:
            assert isinstance(item, BadRow) and item.reason == expected, (rid, item)
            rec = item.record()
            assert rec["line"] == line_no and rec["source"] == str(path)


def test_openai_content_parts_joined_and_roles(input_cases):
    got = _by_line(input_cases / "chats" / "openai.jsonl")
    o4 = got[4]
    assert o4.messages == ({"role": "user", "content": "Say hi politely."},
                           {"role": "assistant", "content": "Hello, nice to meet you."})
    assert [m["role"] for m in got[2].messages] == ["system", "user", "assistant"]
    assert got[1].messages == got[17].messages and got[1].row != got[17].row  # o16 duplicates o1


def test_generate_accepts_prompt_without_answer(input_cases):
    rows = list(iter_chats(str(input_cases / "chats" / "openai.jsonl"), 0, require_answer=False))
    o8 = [r for r in rows if r.row_id == "o8"][0]
    assert isinstance(o8, Chat) and o8.messages[-1]["role"] == "user"


def test_sharegpt_cases(input_cases):
    rows = list(iter_chats(str(input_cases / "chats" / "sharegpt.jsonl"), 0))
    by_id = {r.row_id: r for r in rows}
    assert isinstance(by_id["s1"], Chat)
    assert by_id["s1"].messages == ({"role": "user", "content": "Reverse a list in Python."},
                                    {"role": "assistant", "content": "xs[::-1]"})
    assert [m["role"] for m in by_id["s2"].messages] == ["system", "user", "assistant"]
    assert sum(m["role"] == "assistant" for m in by_id["s3"].messages) == 2
    assert by_id["s4"].reason == "no_user_turn"
    assert by_id["s5"].reason == "unknown_role"
    assert by_id["s6"].messages[1] == {"role": "assistant", "content": "accepted"}


@pytest.mark.parametrize("obj,reason", [
    ([1, 2], "not_a_chat"),
    ({"messages": "hi"}, "not_a_chat"),
    ({"messages": ["hi"]}, "bad_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "bad_type"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, "no_user_turn"),
])
def test_malformed_kinds(obj, reason):
    with pytest.raises(RowError) as e:
        normalize_messages(obj)
    assert e.value.reason == reason


def test_parquet_rows_and_bad_file(tmp_path):
    table = pa.table({"id": ["p1", "p2"], "messages": [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "first"}, {"role": "user", "content": "q"}]]})
    path = tmp_path / "chats.parquet"
    pq.write_table(table, path)
    rows = list(iter_chats(str(path), 1))
    assert isinstance(rows[0], Chat) and rows[0].row == 0 and rows[0].messages[1]["content"] == "a"
    assert isinstance(rows[1], BadRow) and rows[1].reason == "no_user_turn" and rows[1].row == 1
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(BadInputFileError, match="bad.parquet"):
        list(iter_chats(str(bad), 0))
    with pytest.raises(BadInputFileError, match="no such input file"):
        list(iter_chats(str(tmp_path / "missing.jsonl"), 0))
    (tmp_path / "adir.jsonl").mkdir()
    with pytest.raises(BadInputFileError, match="adir.jsonl is a directory"):
        list(iter_chats(str(tmp_path / "adir.jsonl"), 0))
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(BadInputFileError, match="unknown input format"):
        list(iter_chats(str(csv), 0))


def test_spans_cover_every_row_once(input_cases, tmp_path):
    """Shard spans (byte-seeking JSONL reader, row-group Parquet reader) give exactly the rows of a
    whole-file read, in order, for any span size."""
    from pipeline.chats.ingest import plan_shards, plan_spans

    url = str(input_cases / "chats" / "openai.jsonl")
    whole = [(r.row, type(r).__name__) for r in iter_chats(url, 0)]
    for n in (1, 4, 7, 100):
        spans = plan_spans(url, 0, n)
        assert [s.row_start for s in spans] == list(range(0, 21, n))
        got = [(r.row, type(r).__name__) for s in spans for r in iter_chats(url, 0, span=s)]
        assert got == whole
    table = pa.table({"messages": [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                                   for i in range(23)]})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=5)
    purl = str(tmp_path / "c.parquet")
    spans = plan_spans(purl, 1, 4)
    rows = [r.row for s in spans for r in iter_chats(purl, 1, span=s)]
    assert rows == list(range(23)) and len(spans) == 6
    plan = plan_shards([url, purl], 8, max_rows=30)
    # 21 + 8 rows < 30 after four spans, so a fifth one is kept
    assert [(i, s.source, s.row_start) for i, s in plan] == [(0, 0, 0), (1, 0, 8), (2, 0, 16), (3, 1, 0), (4, 1, 8)]


def test_oversized_rows_skipped_before_decoding(tmp_path, monkeypatch):
    from pipeline.chats import ingest as chats

    monkeypatch.setattr(chats, "MAX_ROW_BYTES", 200)
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    big = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 300}]}
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in (good, big, good)))
    rows = list(iter_chats(str(path), 0))
    assert [type(r).__name__ for r in rows] == ["Chat", "BadRow", "Chat"]
    assert rows[1].reason == "row_too_large" and rows[1].row == 1 and "> 200" in rows[1].detail
    pq.write_table(pa.Table.from_pylist([good, big]), tmp_path / "c.parquet")
    rows = list(iter_chats(str(tmp_path / "c.parquet"), 0))
    assert isinstance(rows[0], Chat) and rows[1].reason == "row_too_large" and rows[1].row == 1


def test_reasoning_fields_are_kept_as_reasoning_content():
    q = {"role": "user", "content": "q"}
    for field in ("reasoning_content", "reasoning", "thinking"):
        msgs = normalize_messages({"messages": [q, {"role": "assistant", "content": "a", field: "r"}]})
        assert msgs[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    both = normalize_messages({"messages": [q, {"role": "assistant", "content": "a", "reasoning": "second",
                                                "reasoning_content": "first"}]})
    assert both[1]["reasoning_content"] == "first"
    parts = normalize_messages({"conversations": [{"from": "human", "value": "q"},
                                                  {"from": "gpt", "value": "a", "thinking": [{"type": "text", "text": "r"}]}]})
    assert parts[1]["reasoning_content"] == "r"
    # a turn that only reasons is an answer; one with neither is empty
    assert normalize_messages({"messages": [q, {"role": "assistant", "content": "", "reasoning_content": "r"}]})
    with pytest.raises(RowError) as e:
        normalize_messages({"messages": [q, {"role": "assistant", "content": " ", "reasoning_content": ""}]})
    assert e.value.reason == "empty_answer"
    with pytest.raises(RowError) as e:
        normalize_messages({"messages": [q, {"role": "assistant", "content": "a", "reasoning": 3}]})
    assert e.value.reason == "bad_type" and "reasoning" in e.value.detail
    # inline reasoning is content as written; user turns never carry reasoning
    inline = normalize_messages({"messages": [{**q, "reasoning_content": "x"},
                                              {"role": "assistant", "content": "<think>\nr\n</think>\n\na"}]})
    assert inline == (q, {"role": "assistant", "content": "<think>\nr\n</think>\n\na"})

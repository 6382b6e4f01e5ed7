"""The history rows of a W&B offline run file (tests/unit/training/test_trackers.py,
tests/integration/test_train_stage.py)."""
import glob
import json


def wandb_history(run_dir: str) -> list[dict]:
    """The history rows of a W&B offline run file (``run-<id>.wandb``: a ``:W&B`` header, then the LevelDB
    log format, 32 KiB blocks of CRC32 / length / type framed protobuf ``Record`` chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = open(glob.glob(f"{run_dir}/run-*.wandb")[0], "rb").read()
    assert data[:4] == b":W&B"
    pos, records, chunk = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):
            pos += left  # block trailer / padding
            continue
        if pos + 7 + length > len(data):
            break  # a record cut short by a killed writer
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last chunk of a record
            records.append(chunk)
            chunk = b""
    rows = []
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows

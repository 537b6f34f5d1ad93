"""What a run wrote to its metric sinks, read back: TensorBoard scalars and an offline W&B run's history."""

import json
import struct


def tensorboard_scalars(run_dir):
    """{tag: [(step, value), ...]} of the scalars under run_dir/tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_history(run_dir):
    """History rows of the offline run under run_dir/wandb, read from its transaction log: a
    7-byte header, then LevelDB-style records (crc32c, length, type) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, rows, pending, offset = path.read_bytes(), [], b"", 7
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
            offset += 32768 - offset % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({key: value for key, value in items.items() if not key.startswith("_")})
    return rows

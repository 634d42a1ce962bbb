"""Read records of a dsc dataset with numpy alone, following formats.md (never imports dsc)."""
import hashlib
import json
import sys

import numpy as np


def read(root: str, i: int) -> tuple[np.ndarray, int, str]:
    m = json.load(open(f"{root}/manifest.json"))
    if m["format"] != "dsc" or m["version"].split(".")[0] != "1":
        raise SystemExit(f"unsupported dataset {m['format']} {m['version']}")
    h, w, c = m["record"]["shape"]
    shard, pos = divmod(i, m["records_per_shard"])
    entry = m["shards"][shard]
    records = np.memmap(f"{root}/{entry['file']}", np.uint8, "r", shape=(entry["records"], h, w, c))
    label = int(np.memmap(f"{root}/{m['index']['labels']['file']}", "<i8", "r")[i])
    off = np.memmap(f"{root}/{m['index']['source_offsets']['file']}", "<u8", "r")
    with open(f"{root}/{m['index']['sources']['file']}", "rb") as f:
        f.seek(int(off[i]))
        source = f.read(int(off[i + 1] - off[i])).decode()
    return np.array(records[pos]), label, source


if __name__ == "__main__":
    root, count = sys.argv[1], int(sys.argv[2])
    for i in range(count):
        image, label, source = read(root, i)
        print(json.dumps([i, label, source, list(image.shape), hashlib.sha256(image.tobytes()).hexdigest()]))
    assert "dsc" not in sys.modules

#!/usr/bin/env python
"""Carry a fine-tuned (or converted) native MLA folder of the embedded default off a machine that returns only small
files: its attention tensors travel (bfloat16, in shards under a size limit); every other tensor is the source's
(a conversion and `finetune train=attention` copy them unchanged), so it is read again from the embedded default.

    python benchmarks/finetune/attention_pack.py pack FOLDER OUTDIR [--prefix P] [--shard-mib 15]
    python benchmarks/finetune/attention_pack.py unpack OUTDIR FILES_DIR OUT [--prefix P]

pack writes OUTDIR/P-attn-NN.safetensors; shard 00's metadata lists every tensor of FOLDER with its dtype and
whether it travelled. unpack writes OUT: the files of FILES_DIR (config, tokenizer, provenance: everything of the
folder but its weights), the travelled tensors cast back to their dtype, the others read from the source and checked
against the recorded shapes. The rebuilt folder differs from FOLDER only in the attention tensors' bfloat16 rounding.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ATTENTION = ".self_attn."


def _folder_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    if not out:
        raise SystemExit(f"{folder} holds no .safetensors weights")
    return out


def pack(folder: Path, outdir: Path, prefix: str, shard_mib: float) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    tensors = _folder_tensors(folder)
    layout = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "travels": ATTENTION in n}
              for n, t in tensors.items()}
    travelling = [n for n in sorted(tensors) if layout[n]["travels"]]
    limit = int(shard_mib * 2**20) - 2**16  # room for the header
    shards, current, size = [], {}, 0
    for name in travelling:
        t = tensors[name].to(torch.bfloat16).contiguous()
        if current and size + t.numel() * 2 > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * 2
    shards.append(current)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, shard in enumerate(shards):
        path = outdir / f"{prefix}-attn-{i:02d}.safetensors"
        meta = {"layout": json.dumps(layout), "shards": str(len(shards))} if i == 0 else {}
        save_file(shard, str(path), metadata=meta)
        paths.append(path)
    print(f"packed {len(travelling)} attention tensors of {folder} into {len(paths)} shard(s) in {outdir}")
    return paths


def unpack(packdir: Path, files_dir: Path, out: Path, prefix: str) -> Path:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mla_convert.checkpoint import open_source

    first = packdir / f"{prefix}-attn-00.safetensors"
    with safe_open(str(first), framework="pt") as f:
        meta = f.metadata()
    layout, count = json.loads(meta["layout"]), int(meta["shards"])
    state = {}
    for i in range(count):
        with safe_open(str(packdir / f"{prefix}-attn-{i:02d}.safetensors"), framework="pt") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name).to(getattr(torch, layout[name]["dtype"]))
    source = open_source(None)
    for name, entry in layout.items():
        if entry["travels"]:
            continue
        t = source.get_raw(name).to(getattr(torch, entry["dtype"]))
        if list(t.shape) != entry["shape"]:
            raise SystemExit(f"{name}: the source's {list(t.shape)} is not the packed folder's {entry['shape']}")
        state[name] = t.contiguous()
    missing = [n for n in layout if n not in state]
    if missing:
        raise SystemExit(f"{len(missing)} tensors missing, e.g. {missing[0]}")
    out.mkdir(parents=True, exist_ok=False)
    for item in files_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"rebuilt {out}: {len(state)} tensors ({sum(v['travels'] for v in layout.values())} from {packdir})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("folder", type=Path)
    p.add_argument("outdir", type=Path)
    p.add_argument("--prefix", default="model")
    p.add_argument("--shard-mib", type=float, default=15.0)
    u = sub.add_parser("unpack")
    u.add_argument("packdir", type=Path)
    u.add_argument("files_dir", type=Path)
    u.add_argument("out", type=Path)
    u.add_argument("--prefix", default="model")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.folder, args.outdir, args.prefix, args.shard_mib)
    else:
        unpack(args.packdir, args.files_dir, args.out, args.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())

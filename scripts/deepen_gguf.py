"""Write a GGUF with more layers than a shallower one of the same shape, by repeating its quantized layers: the full
48-layer Qwen3-30B-A3B shape at Q4_K_M from the 8-layer file bench_moe.py makes, without the 62 GB BF16 folder that
llama.cpp's converter would need (speed and memory depend on shapes and formats, not on values).

Usage: .venv/bin/python scripts/deepen_gguf.py SRC.gguf --layers 48 OUT.gguf

Each new layer i copies a source layer whose tensors have the formats llama-quantize gives layer i of an N-layer
model: Q4_K_M keeps attn_v and ffn_down at Q6_K in "more bits" layers (the first and last eighth, and every third
between), so layer i copies a source layer that has Q6_K there when i is one of them and one that has not otherwise.
The tensors are written from the source's memory map, one at a time: memory stays at one tensor.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i, n) (src/llama-quant.cpp): the layers Q4_K_M keeps at Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def field_value(field: gguf.ReaderField):
    """A reader field's value as GGUFWriter takes it (a scalar, a string, or a list of either)."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    reader = gguf.GGUFReader(str(args.src))
    arch = field_value(reader.fields["general.architecture"])
    n_src = field_value(reader.fields[f"{arch}.block_count"])
    by_layer: dict[int, list] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            by_layer.setdefault(int(t.name.split(".")[1]), []).append(t)

    def kinds(i: int) -> tuple:
        return tuple(sorted((t.name.split(".", 2)[2], t.tensor_type.name) for t in by_layer[i]))

    wide = [i for i in range(n_src) if more_bits(i, n_src)]
    narrow = [i for i in range(n_src) if not more_bits(i, n_src)]
    if not wide or not narrow:
        raise SystemExit(f"{args.src} has no layer of one of the two kinds; use a source of 8 layers or more")
    writer = gguf.GGUFWriter(str(args.out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = args.layers if key == f"{arch}.block_count" else field_value(field)
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    plan = []  # (name, source tensor)
    for t in reader.tensors:
        if not t.name.startswith("blk."):
            plan.append((t.name, t))
    for i in range(args.layers):
        pool = wide if more_bits(i, args.layers) else narrow
        src = pool[i % len(pool)]
        assert kinds(src) == kinds(pool[0]), f"source layers {src} and {pool[0]} differ in formats"
        for t in by_layer[src]:
            plan.append((f"blk.{i}.{t.name.split('.', 2)[2]}", t))
    for name, t in plan:  # the reader's array shape: numpy order, bytes a row for quantized tensors
        writer.add_tensor_info(name, list(t.data.shape), t.data.dtype, t.n_bytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in plan:
        writer.write_tensor_data(t.data)
    writer.close()
    print(f"{args.out}: {args.layers} layers from {n_src} ({args.out.stat().st_size / 1e9:.1f} GB)")


if __name__ == "__main__":
    main()

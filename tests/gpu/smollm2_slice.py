"""Write a GGUF holding the first N layers of the real SmolLM2-135M file (tensors copied as stored).

The GPU machine cannot receive the whole 98 MB file; a slice keeps the real tokenizer, embedding and
layers so quantize / generate / eval run there on real weights:  python -m tests.gpu.smollm2_slice 4 out.gguf
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

from model_zoo.loaders.named import named_model_path


def write_slice(n_layers: int, out: str) -> None:
    r = gguf.GGUFReader(str(named_model_path("smollm2-135m")))
    arch = "llama"
    w = gguf.GGUFWriter(out, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if name == f"{arch}.block_count":
            w.add_uint32(name, n_layers)
        elif vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), vtype)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        # quantized blocks go in as their byte rows; the writer derives the element shape from the type
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    write_slice(int(sys.argv[1]), sys.argv[2])

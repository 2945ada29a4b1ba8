"""Load time of a 7B-sized Hugging Face folder, or GGUF file, made from dummy weights
(ppqa/bench/load_time.py).

Writes the folder once (config.json + 5 GB safetensors shards + index + SmolLM2's tokenizer;
skipped when FOLDER already has a config.json, unless --rewrite), then times `load_model`, a read
of every weight to the device and the whole `Engine(FOLDER)` construction, each after dropping the
shards from the page cache (or, with --cached, after reading them through once), and prints one
JSON object (also written to --out). --baseline also times a memory-mapped read.
With --gguf the same weights go into one GGUF file, FOLDER/model.gguf, of F16 or BF16 tensors
(--dtype; written unless present), and that file is timed: streamed reads to a GPU against
--baseline's memory-mapped reads, one tensor at a time.

    python benchmarks/load_time.py --model dummy:codellama-7b+bpe --folder /tmp/ppqa-7b \
        --device cuda --drop-caches [--out load_time.json]
    python benchmarks/load_time.py --model dummy:tiny-gqa+bpe --folder /tmp/tiny-hf --device cpu
    python benchmarks/load_time.py --model dummy:codellama-7b --folder /tmp/ppqa-7b-gguf \
        --gguf --baseline --device cuda
    python benchmarks/load_time.py --model dummy:tiny-gqa --folder /tmp/tiny-gguf --gguf \
        --baseline --device cpu

`+bpe` needs the SmolLM2 GGUF (or its saved tokenizer) in the model cache ($PPQA_HOME/models);
a GGUF file needs no +bpe (it carries a byte-level vocabulary of its own).
"""

import argparse
import json
from pathlib import Path

import torch

from ppqa.bench.load_time import time_load, write_gguf_file, write_hf_folder

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="dummy:codellama-7b+bpe",
                        help="a dummy:<preset>+bpe spec whose weights fill the folder")
    parser.add_argument("--folder", type=Path, required=True, help="where the folder is written")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest shard, in GB")
    parser.add_argument("--rewrite", action="store_true", help="write the folder even if present")
    parser.add_argument("--no-engine", action="store_true", help="skip the Engine construction")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also drop the whole page cache before each timing (root; only on a "
                             "machine of your own, such as the GPU machine)")
    parser.add_argument("--cached", action="store_true",
                        help="time with the shards in the page cache (read through once first) "
                             "instead of evicted")
    parser.add_argument("--baseline", action="store_true",
                        help="also time a memory-mapped read (get_tensor + .to(device)), the "
                             "loader's CPU path, under the same page-cache condition")
    parser.add_argument("--gguf", action="store_true",
                        help="write and time FOLDER/model.gguf (F16 or BF16 tensors) instead of "
                             "safetensors shards; --baseline then times gguf.py's memory-mapped "
                             "path to the device")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()

    dtype = DTYPES[args.dtype]
    result = {}
    timed = args.folder / "model.gguf" if args.gguf else args.folder
    # Generate on the device (seconds for 7B on a GPU), write from host memory.
    if args.gguf and (args.rewrite or not timed.exists()):
        result["written"] = write_gguf_file(args.model, timed, device=args.device, dtype=dtype)
    elif not args.gguf and (args.rewrite or not (args.folder / "config.json").exists()):
        result["written"] = write_hf_folder(args.model, args.folder, device=args.device,
                                            dtype=dtype, shard_bytes=int(args.shard_gb * 1e9))
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    result["load"] = time_load(timed, device=args.device, dtype=dtype,
                               engine=not args.no_engine, drop_caches=args.drop_caches,
                               cached=args.cached, baseline=args.baseline)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

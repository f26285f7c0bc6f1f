"""Write the default model as a Qwen2-architecture HF folder: the same weights, the
q/k/v biases Qwen2 carries set to zero (so it computes what the default model computes),
config.json saying Qwen2ForCausalLM, the tokenizer beside it.

A real model of a second architecture with a tokenizer and known quality, for running the
pipeline end to end on an HF folder that is not Llama (no hub is reachable here):

    .venv/bin/python benchmarks/qwen2_folder.py /tmp/smollm2-qwen2
    make quantize MODEL=/tmp/smollm2-qwen2 SCHEME=W8A16 METHOD=rtn PUBLISH=0
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    args = ap.parse_args()
    from quantpipe.runtime.model.export import export_hf
    from quantpipe.runtime.model.loader import load_model

    model, _, tokenizer = load_model(None, torch.bfloat16)
    export_hf(model, tokenizer, args.out)
    weights = os.path.join(args.out, "model.safetensors")
    state = load_file(weights)
    for name in [n for n in state if n.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                     "self_attn.v_proj.weight"))]:
        state[name.removesuffix("weight") + "bias"] = torch.zeros(state[name].shape[0], dtype=state[name].dtype)
    save_file(state, weights, metadata={"format": "pt"})
    cfg_path = os.path.join(args.out, "config.json")
    cfg = json.loads(open(cfg_path).read())
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
               sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    cfg.pop("attention_bias", None)
    cfg.pop("mlp_bias", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    print(args.out)


if __name__ == "__main__":
    main()
